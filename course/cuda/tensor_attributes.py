"""What a program sees of an emulated tensor's Python attributes. On a GPU box a parameter is an nn.Parameter with
an empty `__dict__`; an emulated one is the emulator's tensor subclass, flagged `_is_param`, whose `__dict__` also
holds its values and device. Loaders that rebuild a parameter from its class or copy its attributes onto a moved copy
must get what they get on a GPU box."""
import torch

STATE = ("_inner", "_device_index", "_block")  # what an emulated tensor is, kept apart from a copy's attributes
OWN_ATTRIBUTES = (*STATE, "_is_param")  # the emulator's, not the program's: a GPU box's parameter has none
_INSTANCE_DICT = torch.Tensor.__dict__["__dict__"]  # the attribute dictionary Python itself reads and writes


def instance_dict(tensor: torch.Tensor) -> dict:
    """A tensor's whole attribute dictionary, the emulator's own attributes included."""
    return _INSTANCE_DICT.__get__(tensor)


def set_instance_dict(tensor: torch.Tensor, attributes: dict) -> None:
    _INSTANCE_DICT.__set__(tensor, attributes)


class ProgramAttributes(dict):
    """An emulated tensor's `__dict__` without the emulator's attributes. Reads see a copy; writes reach the tensor."""

    __slots__ = ("_attributes",)

    def __init__(self, attributes: dict):
        super().__init__((key, value) for key, value in attributes.items() if key not in OWN_ATTRIBUTES)
        self._attributes = attributes

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._attributes[key] = value

    def __delitem__(self, key):
        super().__delitem__(key)
        del self._attributes[key]

    def update(self, *others, **attributes):
        new = dict(*others, **attributes)
        super().update(new)
        self._attributes.update(new)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key, *default):
        if key in self:
            self._attributes.pop(key)
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        del self._attributes[key]
        return key, value

    def clear(self):
        for key in list(self):
            del self[key]


def program_attributes(tensor: torch.Tensor) -> ProgramAttributes:
    return ProgramAttributes(instance_dict(tensor))


def assign_attributes(tensor: torch.Tensor, attributes: dict) -> None:
    """`tensor.__dict__ = attributes`. Another emulated tensor's `__dict__` is taken whole, its values and device
    with it, as torch.utils.swap_tensors swaps two tensors' dictionaries; a program's keeps the tensor's own."""
    if isinstance(attributes, ProgramAttributes):
        set_instance_dict(tensor, attributes._attributes)
        return
    own = instance_dict(tensor)
    set_instance_dict(tensor, {**{key: own[key] for key in OWN_ATTRIBUTES if key in own}, **attributes})


def parameter_from_its_class(data, requires_grad, attributes) -> torch.Tensor:
    """`type(param)(tensor, requires_grad=..., **param.__dict__)`, how accelerate's `set_module_tensor_to_device`
    and PEFT rebuild a parameter: an emulated parameter's class is this one (nn.Parameter flags a tensor subclass
    instead of changing its class), so the call makes the nn.Parameter it makes on a GPU box, and refuses the
    keywords Parameter.__new__ refuses."""
    return torch.nn.Parameter(data, *(() if requires_grad is None else (requires_grad,)), **attributes)
