"""Every collective a training framework uses, on each rank's own GPU: values checked across backends."""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "12364"
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = torch.arange(8, dtype=torch.float32, device=device) + 10 * rank
    out = {}
    t = base.clone(); dist.all_reduce(t, op=dist.ReduceOp.MAX); out["all_reduce_max"] = t.tolist()
    t = base.clone(); dist.broadcast(t, src=1); out["broadcast"] = t.tolist()
    t = base.clone(); dist.reduce(t, dst=0); out["reduce_on_0"] = t.tolist() if rank == 0 else None
    big = torch.empty(8 * world_size, device=device); dist.all_gather_into_tensor(big, base); out["all_gather"] = big.tolist()
    small = torch.empty(8 // world_size, device=device); dist.reduce_scatter_tensor(small, base); out["reduce_scatter"] = small.tolist()
    a2a = torch.empty(8, device=device); dist.all_to_all_single(a2a, base); out["all_to_all"] = a2a.tolist()
    work = dist.all_reduce(base.clone(), async_op=True); work.wait(); out["async_done"] = work.is_completed()
    dist.barrier()
    results = [None] * world_size
    dist.all_gather_object(results, out)
    if rank == 0:
        print("RESULT " + json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)
