"""`torch.distributed.rpc` on emulated GPUs: remote calls run on the emulator, and GPU tensors stay off the wire.

RPC runs each remote Python call in a thread of its agent's pool (`rpc.internal._run_function`, called from C++),
where the emulator's per-thread mode is not active, so a parameter server's `model.to("cuda:0")` would meet CPU-only
PyTorch: the call is run inside the emulator. A tensor on an emulated GPU sent over RPC is refused with TensorPipe's
message for a GPU tensor sent without a device map: device maps (CUDA RPC) are not modelled, and pickling the
tensor's values instead would cut it out of distributed autograd, whose send and receive functions C++ attaches
only to the tensors RPC hands it (a silent loss of gradients).
"""
from __future__ import annotations

import functools

import torch.distributed.rpc.api as api
import torch.distributed.rpc.internal as internal
import torch.utils._pytree as pytree

from course.cuda import devices
from course.cuda.devices import EmulatedTensor
from course.cuda.interception import EmulatorMode


def _run_function(original):
    @functools.wraps(original)
    def run_function(python_udf):
        if devices.active is None:
            return original(python_udf)
        with EmulatorMode():
            return original(python_udf)
    return run_function


def _refuse(tensor):
    raise RuntimeError(
        "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to CPU before sending "
        f"them over RPC. Found tensor on device: {tensor.device} (the GPU emulator does not model RPC device maps, "
        "`TensorPipeRpcBackendOptions.set_device_map`)")


def _builtin(original):
    """A call of a builtin op (`rpc.rpc_sync(to, torch.add, args=...)`) hands its tensors to C++ as they are."""
    @functools.wraps(original)
    def invoke(*args, **kwargs):
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, EmulatedTensor):
                _refuse(leaf)
        return original(*args, **kwargs)
    return invoke


class _EmulatorPickler(internal._InternalRPCPickler):
    """RPC's pickler, with the reducers registered on the one it replaces, refusing emulated tensors."""

    def __init__(self, original):
        super().__init__()
        self._class_reducer_dict = original._class_reducer_dict
        self._dispatch_table[EmulatedTensor] = _refuse


def patches() -> list:
    """(module, replacements) for the emulator to put in place while it runs."""
    return [(api, {name: _builtin(getattr(api, name)) for name in ("_invoke_rpc_builtin", "_invoke_remote_builtin")}),
            (internal, {"_run_function": _run_function(internal._run_function),
                        "_internal_rpc_pickler": _EmulatorPickler(internal._internal_rpc_pickler)})]
