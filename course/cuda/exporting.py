"""`torch.export.export` of a model on an emulated GPU: traced on its host twin, with the GPU written back into its graph.

Export traces with fake tensors made from the model's (FakeTensorMode). A fake of an emulated GPU tensor would be a C++
tensor on a CUDA device: a CPU build's autograd aborts the process on one (getDeviceGuardImpl, "PyTorch is not linked
with support for cuda devices") as soon as a parameter that requires grad meets it, and its composite ops (indexing,
`.cuda()`) raise from the same device guard. So the model is traced as its host twin: the same modules over the inner
host tensors of its parameters and buffers (nothing is copied), with the inputs' inner tensors. The ops and shapes are
the GPU's; the devices are not. Export burns the devices a forward names into its graph ("export will always specialize
on devices", pytorch#151010): `torch.arange(T, device=idx.device)`, a mask's `torch.ones(..., device=x.device)` and an
LSTM's zero state become nodes with `device=cuda:0` on a GPU. So, while the twin is traced, the model (torch.nn's code
included) asking a tensor's device gets the GPU's answer, a call that names the GPU makes its fake on the host, and the
nodes each call adds are marked with where the GPU's program puts its tensor; afterwards the GPU is written back into
the marked nodes, as torch.export.passes.move_to_device_pass rewrites a program's burnt-in devices (node.meta["val"]
keeps the twin's host fakes). The emulated parameters and buffers are put back, so `ep.module()(x)` runs on the
emulated GPU, timed, with CPU torch's values. Refused by name: a node naming a device that no marked call made
(PyTorch's code outside the libraries models call asked a fake for it), a tensor moved without a copy in the graph,
a constant made on a device a PyTorch function asked inside, devices inside control-flow branches, a second GPU,
CUDA autocast (it casts GPU tensors only), strict=True (TorchDynamo would trace the emulator's own Python) and
models and inputs spread over several devices.
`ep.run_decompositions()` re-traces from the GPU parameters, and is refused as every fake tensor of a GPU tensor is
(cuda_api._fake_of).
"""
from __future__ import annotations

import contextlib
import copy
import sys
import sysconfig
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.overrides import TorchFunctionMode, _len_torch_function_stack

from course.cuda import inner_factories
from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor
from course.cuda.interception import EmulatorMode

_export = torch.export.export


def _not_modelled(what: str, advice: str = "export the model on the CPU (its graph names cpu where a GPU's names "
                                           "cuda), or run it eagerly") -> RuntimeError:
    return not_modelled(f"torch.export.export of {what} on emulated GPUs", advice)


def _host(tensor):
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


_DEVICE_QUERIES = (torch.Tensor.device, torch.Tensor.is_cuda, torch.Tensor.is_cpu)
_STDLIB = sysconfig.get_paths()["stdlib"]
_GPU, _HOST = "cuda", "cpu"  # where a traced tensor lives in the GPU's program: node.meta[_PLACED] of its call
_ASKED_INSIDE = "asked inside"  # or a call whose own code asked a tensor's device, where the twin answers the host's:
# its tensors are where its inputs are, unless it made one on the device it asked (refused)
_PLACED, _CALL = "course_placement", "course_call"  # node.meta keys: where its tensor lives, the call that made it
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


# PyTorch's Python libraries that models call, and that never run inside export's dispatch: their code is the model's,
# so a module asking its input's device (an LSTM's zero state, a Normal's rsample) gets a GPU's answer, as on a GPU.
_MODEL_LIBRARIES = ("torch.nn.", "torch.distributions.", "torch.functional", "torch._lowrank")


def _internal(frame) -> bool:
    """Export's, PyTorch's own (but _MODEL_LIBRARIES), the emulator's, the standard library's or generated code."""
    module = frame.f_globals.get("__name__") or ""
    return (module.partition(".")[0] in ("torch", "course") and not module.startswith(_MODEL_LIBRARIES)) or \
        frame.f_code.co_filename.startswith(("<", _STDLIB))


def _asked_by_the_model(export_caller) -> bool:
    """Whether the code that asked (the caller's caller, past the torch-function modes export stacks) is the model's
    (see _internal), not the call of export itself."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame is not None and not _internal(frame) and frame is not export_caller


def _placements(graph) -> dict:
    """Where each node's tensor lives in the GPU's program: where its call put it (a device it named, or one
    like another tensor's), else on the GPU if any input is there (a host scalar meets a GPU tensor there too),
    as FakeTensor's device propagation gives on a GPU (torch/_subclasses/fake_tensor.py, FakeTensor._find_common_device).
    Placeholders are the GPU's parameters, buffers and inputs unless marked (lifted host constants)."""
    placed = {}
    for node in graph.nodes:
        mark = node.meta.get(_PLACED)
        placed[node] = mark if mark in (_GPU, _HOST) else (
            _GPU if node.op == "placeholder" or any(placed.get(n) == _GPU for n in node.all_input_nodes) else _HOST)
    return placed


def _traced_node(tensor):
    mode = get_proxy_mode()
    slot = get_proxy_slot(tensor, mode.tracer, None) if mode is not None and isinstance(tensor, torch.Tensor) else None
    return slot.proxy.node if slot is not None else None


def _placement_of(tensor) -> str:
    node = _traced_node(tensor)
    return _placements(node.graph)[node] if node is not None else _HOST


# While this thread traces a twin: .caller, .index: the frame that called export and its GPU; .inside: whether the
# model asked a device within the call _OnTheHost runs (None: none runs).
_tracing = threading.local()
_fake_device = FakeTensor.device


def _fake_tensor_device(self) -> torch.device:
    """FakeTensor.device while a twin is traced: the forward's inputs are fake tensors, whose device is a property
    no torch-function mode sees. Asked by the model, it answers the GPU's device for a tensor the GPU would hold,
    unless _OnTheHost is running a PyTorch function handed to it whole: the calls inside do not reach the mode, so
    they get the host's, and the function's call is marked as one whose devices the twin cannot give."""
    caller = getattr(_tracing, "caller", None)
    if caller is not None and _asked_by_the_model(caller):
        if getattr(_tracing, "inside", None) is not None:
            _tracing.inside = True
        elif _placement_of(self) == _GPU:
            return torch.device("cuda", _tracing.index)
    return _fake_device.fget(self)


def _gpu_index(device, index: int):
    """The GPU a device argument names (None for the host's), refusing the other GPUs."""
    if isinstance(device, torch.Tensor) or device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        named = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            return None
        named = torch.cuda.current_device() if device.index is None else device.index
    if named != index:
        raise _not_modelled(f"a model whose forward moves tensors from cuda:{index} to cuda:{named}")
    return named


class _OnTheHost(TorchFunctionMode):
    """Under the twin's trace, where every tensor is a host fake. A call that names the GPU (`device=x.device`,
    `.cuda()`, `.to(device)`) makes its fake on the host instead, and the graph nodes it adds are marked as the
    GPU's (`_PLACED`), so that export() can write the GPU back into them; one that names the host, or makes a
    tensor from nothing on the default device, is marked as the host's; `.to(other)` as other's. The model's
    own code asking a tensor's device gets the GPU's answer for the tensors the GPU would hold, and PyTorch's
    functions that make a tensor on a device they ask midway run op by op under the mode (_INLINED)."""

    def __init__(self, export_caller, index: int):
        super().__init__()
        self.export_caller, self.index = export_caller, index

    def _answer(self, func, tensor):
        on_gpu = _placement_of(tensor) == _GPU
        if func is torch.Tensor.get_device:
            return self.index if on_gpu else -1
        if func.__self__ is torch.Tensor.device:
            return torch.device("cuda", self.index) if on_gpu else torch.device("cpu")
        return on_gpu if func.__self__ is torch.Tensor.is_cuda else not on_gpu

    def _on_host(self, func, args, kwargs, host):
        """The call made on the host, and where the GPU's program would put what it makes (None: like its
        inputs). `host` is where a call naming the host puts it: None unless the model named it (PyTorch's own
        code names the device a fake answered it, the host's, where on a GPU it would name the GPU)."""
        if func is torch.Tensor.cuda:
            _gpu_index(args[1] if len(args) > 1 else kwargs.get("device", torch.cuda.current_device()), self.index)
            return _GPU, torch.Tensor.to, args[:1], {"device": "cpu"}
        if func is torch.Tensor.cpu:
            return host, func, args, kwargs
        if "device" in kwargs and kwargs["device"] is not None:
            if _gpu_index(kwargs["device"], self.index) is None:
                return host, func, args, kwargs
            return _GPU, func, args, dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1:
            if isinstance(args[1], torch.Tensor):
                return _placement_of(args[1]), func, args, kwargs
            if not isinstance(args[1], torch.dtype):
                if _gpu_index(args[1], self.index) is None:
                    return host, func, args, kwargs
                return _GPU, func, (args[0], "cpu") + args[2:], kwargs
        if not any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves((args, kwargs))):
            return _HOST, func, args, kwargs  # a factory on the default device (a GPU one comes with device=)
        return None, func, args, kwargs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cuda"):  # it casts GPU tensors only: the twin's graph would keep float32
            raise _not_modelled("a model that runs under CUDA autocast")
        by_the_model = _asked_by_the_model(self.export_caller)
        if (getattr(func, "__self__", None) in _DEVICE_QUERIES or func is torch.Tensor.get_device) and by_the_model:
            return self._answer(func, args[0])
        if func in _INLINED:  # its body, op by op under this mode, makes its tensors on the device it asks
            return _INLINED[func](*args, **kwargs)
        placement, func, args, kwargs = self._on_host(func, args, kwargs, _HOST if by_the_model else None)
        mode = get_proxy_mode()
        last = next(reversed(mode.tracer.graph.nodes), None) if mode is not None else None
        _tracing.inside = False
        try:
            out = func(*args, **kwargs)
            if _tracing.inside and placement is None:
                placement = _ASKED_INSIDE
        finally:
            _tracing.inside = None
        if last is None or placement is None:
            return out
        for node in reversed(mode.tracer.graph.nodes):
            if node is last:
                break
            node.meta.setdefault(_PLACED, placement)
            node.meta.setdefault(_CALL, getattr(func, "__qualname__", str(func)))
        node = _traced_node(out)
        if placement != _ASKED_INSIDE and node is not None and node.meta.get(_PLACED) != placement and \
                _placements(node.graph)[node] != placement:
            raise _not_modelled(f"a model whose forward moves a tensor {'to' if placement == _GPU else 'off'} its "
                                "GPU without a copy in the graph")
        return out


# PyTorch's functions that hand themselves to torch-function handling and make a tensor on a device they ask midway
# (F.embedding_bag, nn.MultiheadAttention's add_zero_attn): run as the emulator runs them (inner_factories.py).
_INLINED = inner_factories.handlers(lambda: _OnTheHost(_tracing.caller, _tracing.index))


@contextlib.contextmanager
def _instead_of_the_emulators(mode):
    """The thread's torch-function modes without the emulator's own (the twin's factories stay on the host, as
    export's fake ones), with `mode` under the rest; the stack is put back afterwards."""
    modes = [torch._C._pop_torch_function_stack() for _ in range(_len_torch_function_stack())][::-1]
    try:
        for kept in [mode] + [m for m in modes if not isinstance(m, EmulatorMode)]:
            torch._C._push_on_torch_function_stack(kept)
        yield
    finally:
        for _ in range(_len_torch_function_stack()):
            torch._C._pop_torch_function_stack()
        for kept in modes:
            torch._C._push_on_torch_function_stack(kept)


def _names_a_device(node) -> bool:
    return any(isinstance(leaf, torch.device) for leaf in torch.utils._pytree.tree_leaves((node.args, node.kwargs)))


def _asked_inside(node) -> RuntimeError:
    return _not_modelled(f"a model whose forward calls {node.meta[_CALL]}, which makes a tensor on a device it asks "
                         "inside")


def _write_the_gpu_back(program, index: int, gpu_state: set) -> None:
    """The twin's graph names the host wherever the GPU's names the GPU: write cuda:index into the nodes whose
    tensors the GPU holds (those _OnTheHost marked, and `_assert_tensor_metadata`, which export adds to check a
    `.to()`'s input), and refuse by name a node that names a device for a call nobody marked (PyTorch's own code
    outside torch.nn asked a fake its device), or one whose tensor would not be where the GPU's program has it."""
    for module in program.graph_module.modules():  # the graphs of torch.cond's branches and other subgraphs
        if module is not program.graph_module and isinstance(module, torch.fx.GraphModule) and any(
                _names_a_device(node) for node in module.graph.nodes):
            raise _not_modelled("a model whose forward names a device inside a control-flow branch")
    constants = program.graph_signature.inputs_to_lifted_tensor_constants
    for node in program.graph.nodes:
        if node.op == "placeholder" and constants.get(node.name) not in gpu_state | {None}:
            marks = {user.meta.get(_PLACED) for user in node.users}
            if marks == {_GPU}:
                name = constants[node.name]  # torch.tensor(data, device=x.device): the constant is the GPU's
                program._constants[name] = program._constants[name].to(f"cuda:{index}")
            elif _ASKED_INSIDE in marks:  # made inside a call on the device the twin answered: the host
                raise _asked_inside(next(user for user in node.users if user.meta.get(_PLACED) == _ASKED_INSIDE))
            else:
                node.meta[_PLACED] = _HOST
    placed = _placements(program.graph)
    gpu = torch.device("cuda", index)
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _ASSERT_METADATA:
            placed[node] = placed[node.args[0]]
        elif _names_a_device(node) and node.meta.get(_PLACED) == _ASKED_INSIDE:
            raise _asked_inside(node)
        elif _names_a_device(node) and _PLACED not in node.meta:
            raise _not_modelled("a model whose forward names a device where PyTorch's code asked a tensor for it")
        if _names_a_device(node):
            if placed[node] == _GPU:
                node.args, node.kwargs = torch.utils._pytree.tree_map_only(
                    torch.device, lambda device: gpu if device.type == "cpu" else device, (node.args, node.kwargs))
        elif placed[node] != (_GPU if any(placed[n] == _GPU for n in node.all_input_nodes) else _HOST):
            raise _not_modelled(f"a model whose forward moves a tensor {'to' if placed[node] == _GPU else 'off'} "
                                "its GPU without a copy in the graph")
    program.graph_module.recompile()


def export(mod, args=(), kwargs=None, **options):
    """`torch.export.export` while emulating: PyTorch's own for host models, the host twin's for a model on one
    emulated GPU (see above)."""
    kwargs = kwargs or {}
    state = dict(mod.state_dict(keep_vars=True)) if isinstance(mod, torch.nn.Module) else {}
    named_buffers = dict(mod.named_buffers()) if isinstance(mod, torch.nn.Module) else {}
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, list(state.values()),
                                                          list(named_buffers.values())))
               if isinstance(t, torch.Tensor)]
    devices = {t.device for t in tensors}
    if not any(t.is_cuda for t in tensors):
        return _export(mod, args, kwargs, **options)
    if len(devices) > 1 or not all(isinstance(t, EmulatedTensor) for t in tensors):
        raise _not_modelled(f"a model or inputs spread over {sorted(map(str, devices))}")
    if options.get("strict"):  # TorchDynamo would trace the emulator's own Python (its torch.cuda, Module.__call__)
        raise _not_modelled("a model traced with strict=True (TorchDynamo)", "export it with strict=False, the default")
    memo = {}
    for tensor in list(mod.parameters()) + list(named_buffers.values()):
        host = _host(tensor)
        memo[id(tensor)] = torch.nn.Parameter(host, tensor.requires_grad) if isinstance(
            tensor, torch.nn.Parameter) else host
    twin = copy.deepcopy(mod, memo)
    host_args, host_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, _host, (args, kwargs))
    _tracing.caller, _tracing.index = sys._getframe(1), tensors[0].get_device()
    FakeTensor.device = property(_fake_tensor_device)
    try:
        with _instead_of_the_emulators(_OnTheHost(_tracing.caller, _tracing.index)):
            program = _export(twin, host_args, host_kwargs, **options)
    finally:
        FakeTensor.device = _fake_device
        _tracing.caller = None
    _write_the_gpu_back(program, _tracing.index, set(state) | set(named_buffers))
    for table in (program._state_dict, program._constants):
        for name in table:
            if name in state or name in named_buffers:
                table[name] = state.get(name, named_buffers.get(name))
    program._example_inputs = (tuple(args), kwargs)
    return program
