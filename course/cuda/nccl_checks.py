"""What ProcessGroupNCCL refuses, and the reductions where NCCL and gloo (which moves the values here) differ.

gloo takes dtypes, layouts and reduce ops that NCCL refuses (complex or int16 tensors reaching the group,
non-contiguous collective inputs, BAND/BOR/BXOR, PREMUL_SUM on integers), so without these checks a program
would run on the emulator and fail on a GPU box. The checks and their errors are ProcessGroupNCCL's
(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: check_gpu_single_tensor, getNcclDataType, getNcclReduceOp).
NCCL's AVG of integers (ncclAvg: a sum, then a division rounding toward zero) is one gloo cannot do in place on
an integer tensor, so it runs here as a gloo SUM followed by that division.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# ProcessGroupNCCL's ncclDataType map (the float8 types included, NCCL >= 2.19 has them).
NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.float32, torch.float64, torch.int32, torch.int64,
                         torch.float16, torch.bool, torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn,
                         torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
_PREMUL_SUM_DTYPES = frozenset({torch.float16, torch.float32, torch.bfloat16, torch.float64})
_BITWISE = {dist.ReduceOp.BAND: "BAND", dist.ReduceOp.BOR: "BOR", dist.ReduceOp.BXOR: "BXOR"}


def _dense_in_its_format(tensor) -> bool:
    """`tensor.is_contiguous(tensor.suggest_memory_format())`: contiguous, or channels-last for 4-d and 5-d."""
    if tensor.is_contiguous():
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return tensor.dim() in formats and tensor.is_contiguous(memory_format=formats[tensor.dim()])


def check_tensors(tensors, p2p: bool = False) -> None:
    """check_gpu_single_tensor and getNcclDataType for each tensor (send/recv may be non-contiguous, with a warning
    on a GPU that the two sides must agree on the layout; sparse tensors keep the path they had)."""
    for tensor in tensors:
        if not p2p and tensor.layout == torch.strided and not _dense_in_its_format(tensor):
            raise ValueError("Tensors must be contiguous")
        if tensor.dtype not in NCCL_DTYPES:
            raise TypeError(f"Input tensor data type is not supported for NCCL process group: {tensor.dtype}")


def check_distinct_gpus(gpus: list[int], rank: int) -> None:
    """NCCL's communicator setup (init.cc) refuses two ranks of one communicator on the same GPU: a program whose
    ranks never call set_device puts an object collective's tensors on cuda:0 in every rank. `gpus` holds each
    group rank's physical GPU (-1: no GPU tensor in this call, no NCCL communicator). In a collective every rank
    raises here, the offending ones naming themselves as NCCL does, so none is left waiting; of a send and its
    receive, the receiver (which alone learns both GPUs)."""
    first = {}
    pairs = []
    for r, gpu in enumerate(gpus):
        if gpu >= 0:
            if gpu in first:
                pairs.append((r, first[gpu], gpu))
            first.setdefault(gpu, r)
    if not pairs:
        return
    own = [(r, other, gpu) for r, other, gpu in pairs if rank in (r, other)]
    r, other, gpu = own[0] if own else pairs[0]
    if rank == other:
        r, other = other, r
    raise dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp, invalid usage (run with NCCL_DEBUG=WARN for details)\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
        f"Duplicate GPU detected : rank {r} and rank {other} both on CUDA device {gpu} "
        "(call torch.cuda.set_device(local_rank) in each rank, or init_process_group(device_id=...))")


def check_gathered(output, input, world_size: int) -> None:
    """ProcessGroupNCCL::_allgather_base's checks on all_gather_into_tensor (gloo's own refusal names gloo)."""
    if input.dtype != output.dtype:
        raise TypeError("output tensor must have the same type as input tensor")
    if input.numel() * world_size != output.numel():
        raise ValueError("output tensor size must be equal to world_size times input tensor size")


def check_scattered(output, input, world_size: int) -> None:
    """ProcessGroupNCCL::_reduce_scatter_base's checks on reduce_scatter_tensor."""
    if input.dtype != output.dtype:
        raise TypeError("input tensor must be the same type as the output tensor.")
    if input.numel() != output.numel() * world_size:
        raise ValueError("input tensor must be the same size as output size times world size")


def reduction(opts, tensors, world_size: int):
    """getNcclReduceOp's checks on `opts.reduceOp` for these tensors; an integer AVG becomes a SUM, and the
    function returned divides the outputs it is given afterwards (it does nothing for any other reduction)."""
    op = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp
    dtypes = {t.dtype for t in tensors}
    if op in _BITWISE:
        raise ValueError(f"Cannot use ReduceOp.{_BITWISE[op]} with NCCL")
    if op == dist.ReduceOp.AVG and torch.bool in dtypes:
        raise TypeError("Cannot use ReduceOp.AVG with boolean inputs")
    if op == dist.ReduceOp.PREMUL_SUM and not dtypes <= _PREMUL_SUM_DTYPES:
        raise TypeError("PreMulSum Data type must be half, float, bfloat16 or double")
    if op == dist.ReduceOp.AVG and any(not (d.is_floating_point or d.is_complex) for d in dtypes):
        opts.reduceOp = dist.ReduceOp.SUM
        return lambda outputs: [t.div_(world_size, rounding_mode="trunc") for t in outputs]
    return lambda outputs: None
