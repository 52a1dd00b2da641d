"""torch.distributed.rpc on emulated GPUs (course/cuda/rpc.py): remote calls run on the emulator, and a tensor on an
emulated GPU is refused at the wire as TensorPipe refuses a CUDA tensor sent without a device map."""
import pytest
import torch
import torch.distributed.rpc as rpc

import course


def _sum_on_gpu(values, device):
    """What a parameter server does: compute on its GPU, answer with a CPU tensor."""
    return (torch.tensor(values, device=device) * 2).sum().cpu()


def test_remote_call_runs_on_the_emulated_gpu_and_gpu_tensors_are_refused(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(course.lessons.ranks.free_port()))
    with course.emulate(gpus=2):
        rpc.init_rpc("server", rank=0, world_size=1)
        try:
            answer = rpc.rpc_sync("server", _sum_on_gpu, args=([1.0, 2.0, 3.0], "cuda:1"))
            with pytest.raises(RuntimeError, match="only supports CPU tensors by default.*cuda:0"):
                rpc.rpc_sync("server", torch.add, args=(torch.ones(2, device="cuda:0"), 1))
        finally:
            rpc.shutdown()
    assert type(answer) is torch.Tensor and answer.item() == 12.0
