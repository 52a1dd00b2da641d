"""`torch.FloatTensor` and the other legacy CPU tensor types, and tensors made from lists of GPU scalars.

PyTorch's legacy types answer `isinstance` in C++ from the tensor's dispatch key, and an emulated GPU tensor's C++
device is the CPU: `isinstance(cuda_x, torch.FloatTensor)` would be True, a silently wrong branch in type-checking
code (False on a GPU box, where `torch.cuda.FloatTensor` is the one that answers True). While the emulator runs,
each of these names is a class that answers for host tensors only and builds tensors as PyTorch's type does.

`torch.LongTensor([[top_index[i][0] for i in range(batch)]])` (the chatbot tutorial) and `torch.tensor([loss_a,
loss_b])` read GPU scalars: PyTorch's C++ reads each one with a copy to the host. On a CPU build it would read the
emulated tensor's storage, which holds nothing, so those scalars are first copied to the host here.
"""
from __future__ import annotations

import torch

from course.cuda.devices import CPU, EmulatedTensor
from course.cuda.transfers import to_host_copy

NAMES = ("FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor", "ShortTensor",
         "IntTensor", "LongTensor", "BoolTensor")


def holds_gpu_tensors(data) -> bool:
    """Whether nested lists or tuples hold emulated GPU tensors (which C++ would try to read in place). Nested lists
    are judged by their first item, and a list of numbers by all its items up to a thousand or so: metric code
    mixes numbers and GPU scalars (`torch.tensor([loss.item(), n, correct.sum()])`), and a long list of numbers is
    not walked on every call."""
    if not isinstance(data, (list, tuple)):
        return False  # a tensor itself: `torch.tensor(gpu_tensor)` copies it where it is, as on a GPU
    while data and isinstance(data[0], (list, tuple)):
        data = data[0]
    items = data if len(data) <= _WALKED_ITEMS else data[:1]
    return any(isinstance(item, EmulatedTensor) and item._device_index != CPU for item in items)


_WALKED_ITEMS = 1024


def on_host(data):
    """Nested lists and tuples with each emulated tensor replaced by its host copy (its dtype kept, which a Python
    number would lose: a list of float64 scalars makes a float64 tensor)."""
    if isinstance(data, EmulatedTensor):
        return to_host_copy(data)
    if isinstance(data, (list, tuple)):
        return type(data)(on_host(item) for item in data)
    return data


class _HostTypeMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._original) and not (isinstance(obj, EmulatedTensor) and obj._device_index != CPU)


def _host_type(name: str):
    original = getattr(torch, name)

    def __new__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], EmulatedTensor) and args[0]._device_index != CPU:
            raise type_mismatch(name, "cpu", args[0])
        if args and holds_gpu_tensors(args[0]):
            args = (on_host(args[0]),) + args[1:]
        return original(*args, **kwargs)

    return _HostTypeMeta(name, (), {"__new__": __new__, "_original": original, "dtype": original.dtype,
                                    "is_cuda": False, "is_sparse": False, "layout": torch.strided,
                                    "__module__": "torch"})


HOST_TYPES = {name: _host_type(name) for name in NAMES}


def type_mismatch(name: str, device_type: str, other: torch.Tensor) -> TypeError:
    """tensor_new.cpp's error for `torch.FloatTensor(t)` or `torch.cuda.FloatTensor(t)` with a tensor of another dtype
    or device type, in c10's words for TensorOptions: the host constructor's own error for a meta tensor of the
    other's dtype gives them, and the devices are put in."""
    try:
        HOST_TYPES[name]._original(torch.empty(0, dtype=other.dtype, device="meta"))
    except TypeError as error:
        expected, got = str(error).split(" (got ", 1)
    return TypeError(f"{expected.replace('device=cpu', f'device={device_type}', 1)} "
                     f"(got {got.replace('device=meta', f'device={other.device}', 1)}")


def _original_type(value):
    return value._original if isinstance(value, _HostTypeMeta) else value


_set_default_tensor_type = torch.set_default_tensor_type
_gpu_default = False  # whether a `torch.cuda.*Tensor` type made the GPU the default device
_legacy_new = torch._C.TensorBase.__new__


def _on_the_gpu_by_default(*args, **kwargs):
    """`torch.Tensor(2, 3)` or `torch.Tensor([1., 2.])` after a CUDA default tensor type: PyTorch's legacy
    constructor makes it on the current GPU (old SSD and YOLO code relies on it); set_default_device does not
    reach that constructor, so while such a type is the default it is this function. Its signature is C's
    `(*args, **kwargs)`: importing torch._dynamo (torch.compile, torch.eye's reference) checks that its polyfill
    for `Tensor.__new__` matches the function it finds there."""
    cls, *args = args
    if cls is not torch.Tensor or any(isinstance(arg, torch.Tensor) for arg in args):
        return _legacy_new(cls, *args, **kwargs)
    device = kwargs.pop("device", None)
    if device is not None and torch.device(device).type != "cuda":  # tensor_new.cpp's check_legacy_ctor_device
        raise RuntimeError(f"legacy constructor expects device type: cuda but device type: "
                           f"{torch.device(device).type} was passed")
    return _legacy_new(cls, *args, **kwargs).to(torch.cuda.current_device() if device is None else device)


def set_default_tensor_type(t):
    """`torch.set_default_tensor_type(torch.FloatTensor)` with the class above: PyTorch's C++ wants its own.
    A CUDA type (`torch.cuda.DoubleTensor` or its name) sets its dtype and makes factories without a device make
    tensors on the current GPU, as CUDA's backend does on a GPU box; a CPU type brings them back to the host."""
    global _gpu_default
    name = t if isinstance(t, str) else f"{t.__module__}.{t.__name__}"
    host_type = getattr(torch, name.rsplit(".", 1)[1], t)  # PyTorch would import a name: the class above here
    if name.startswith("torch.cuda."):
        _set_default_tensor_type(_original_type(host_type))
        torch.set_default_device("cuda")
        torch.Tensor.__new__ = staticmethod(_on_the_gpu_by_default)
        _gpu_default = True
        return
    host_by_default()
    _set_default_tensor_type(_original_type(host_type if isinstance(t, str) else t))


def gpu_by_default() -> bool:
    """Whether a `torch.cuda.*Tensor` type is the default one."""
    return _gpu_default


def host_by_default() -> None:
    """Undo what a CUDA default tensor type changed (also when the emulator stops), the default dtype aside."""
    global _gpu_default
    if _gpu_default:
        torch.set_default_device(None)
        del torch.Tensor.__new__
        _gpu_default = False


PATCHES = {**HOST_TYPES, "set_default_tensor_type": set_default_tensor_type}
