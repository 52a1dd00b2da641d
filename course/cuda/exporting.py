"""`torch.export.export` of a model on an emulated GPU: traced on its host twin, where its graph does not name a device.

Export traces with fake tensors made from the model's (FakeTensorMode). A fake of an emulated GPU tensor would be a C++
tensor on a CUDA device: a CPU build's autograd aborts the process on one (getDeviceGuardImpl, "PyTorch is not linked
with support for cuda devices") as soon as a parameter that requires grad meets it, and its composite ops (indexing,
`.cuda()`) raise from the same device guard. So the model is traced as its host twin: the same modules over the inner
host tensors of its parameters and buffers (nothing is copied), with the inputs' inner tensors. The twin's graph is
the GPU's wherever the graph holds no device: the ops and shapes are the same, and the emulated parameters and buffers
are put back in the ExportedProgram, so `ep.module()(x)` runs on the emulated GPU, timed, with CPU torch's values.
Where the twin's graph could differ from a GPU's, export is refused, naming why: a forward that names a device
(`device=x.device`, `.cuda()`, `.to(device)`; its graph would say cpu where a GPU's says cuda, and PyTorch's LSTM is
one), a forward that asks a tensor's device (`if x.is_cuda:` would take the host's branch), CUDA autocast (it casts
GPU tensors only), and models and inputs spread over several devices. `ep.run_decompositions()` re-traces from the
GPU parameters, and is refused as every fake tensor of a GPU tensor is (cuda_api._fake_of).
"""
from __future__ import annotations

import contextlib
import copy
import sys
import sysconfig
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode, _len_torch_function_stack

from course.cuda.cuda_bindings import not_modelled
from course.cuda.devices import EmulatedTensor
from course.cuda.interception import EmulatorMode

_export = torch.export.export


def _not_modelled(what: str) -> RuntimeError:
    return not_modelled(f"torch.export.export of {what} on emulated GPUs",
                        "export the model on the CPU (its graph is the same), or run it eagerly")


def _host(tensor):
    return tensor._inner if isinstance(tensor, EmulatedTensor) else tensor


def _names_a_gpu(value) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    return (isinstance(value, int) and not isinstance(value, bool)) or getattr(value, "type", None) == "cuda"


_DEVICE_QUERIES = (torch.Tensor.device, torch.Tensor.is_cuda, torch.Tensor.is_cpu)
_STDLIB = sysconfig.get_paths()["stdlib"]


def _internal(frame) -> bool:
    filename = frame.f_code.co_filename
    return (frame.f_globals.get("__name__") or "").partition(".")[0] in ("torch", "course") or \
        filename.startswith(("<", _STDLIB))


def _asked_by_the_model(export_caller) -> bool:
    """Whether the code that asked (the caller's caller, past the torch-function modes export stacks) is the model's:
    not torch's, the emulator's, the standard library's or generated (`<string>`), nor the call of export itself."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame is not None and not _internal(frame) and frame is not export_caller


_tracing = threading.local()  # .caller: the frame that called export, while this thread traces a twin
_fake_device = FakeTensor.device


def _fake_tensor_device(self) -> torch.device:
    """FakeTensor.device while a twin is traced: the forward's inputs are fake tensors, whose device is a property
    no torch-function mode sees; asked by the model, it would answer the twin's cpu."""
    caller = getattr(_tracing, "caller", None)
    if caller is not None and _asked_by_the_model(caller):
        raise _not_modelled("a model whose forward asks a tensor's device")
    return _fake_device.fget(self)


class _NoGPUs(TorchFunctionMode):
    """Under the twin's trace: a call that names a GPU is refused before it makes a fake tensor there (whose device
    guard would fail, or abort); one that names the host's device is caught in the graph afterwards. The model's own
    code asking a tensor's device (`if x.is_cuda:`) would get the twin's answer and might trace another branch:
    refused too; PyTorch's own code asking it (its branches are the same on both devices) and export's go on."""

    def __init__(self, export_caller):
        super().__init__()
        self.export_caller = export_caller

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_autocast_enabled("cuda"):  # it casts GPU tensors only: the twin's graph would keep float32
            raise _not_modelled("a model that runs under CUDA autocast")
        if (getattr(func, "__self__", None) in _DEVICE_QUERIES or func is torch.Tensor.get_device) and \
                _asked_by_the_model(self.export_caller):
            raise _not_modelled("a model whose forward asks a tensor's device")
        if func is torch.Tensor.cuda or _names_a_gpu(kwargs.get("device")) or (
                func is torch.device and args and _names_a_gpu(args[0])) or (
                func is torch.Tensor.to and any(_names_a_gpu(a) for a in args[1:])):
            raise _not_modelled("a model whose forward names a device")
        return func(*args, **kwargs)


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
    memo = {}
    for tensor in list(mod.parameters()) + list(named_buffers.values()):
        host = _host(tensor)
        memo[id(tensor)] = torch.nn.Parameter(host, tensor.requires_grad) if isinstance(
            tensor, torch.nn.Parameter) else host
    twin = copy.deepcopy(mod, memo)
    host_args, host_kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, _host, (args, kwargs))
    _tracing.caller = sys._getframe(1)
    FakeTensor.device = property(_fake_tensor_device)
    try:
        with _instead_of_the_emulators(_NoGPUs(_tracing.caller)):
            program = _export(twin, host_args, host_kwargs, **options)
    finally:
        FakeTensor.device = _fake_device
        _tracing.caller = None
    for node in program.graph.nodes:
        if any(isinstance(leaf, torch.device) for leaf in torch.utils._pytree.tree_leaves((node.args, node.kwargs))):
            raise _not_modelled("a model whose forward names a device")
    for table in (program._state_dict, program._constants):
        for name in table:
            if name in state or name in named_buffers:
                table[name] = state.get(name, named_buffers.get(name))
    program._example_inputs = (tuple(args), kwargs)
    return program
