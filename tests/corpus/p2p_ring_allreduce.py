"""A hand-written ring all-reduce with isend/irecv, compared with dist.all_reduce (the classic exercise)."""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def ring_allreduce(tensor, rank, world_size):
    chunks = list(tensor.chunk(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    buffer = torch.empty_like(chunks[0])
    for step in range(world_size - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - step) % world_size, (rank - step - 1) % world_size
        req = dist.isend(chunks[send_idx].contiguous(), right)
        dist.recv(buffer, left)
        chunks[recv_idx] += buffer
        req.wait()
    for step in range(world_size - 1):  # all-gather
        send_idx, recv_idx = (rank + 1 - step) % world_size, (rank - step) % world_size
        req = dist.isend(chunks[send_idx].contiguous(), right)
        dist.recv(buffer, left)
        chunks[recv_idx].copy_(buffer)
        req.wait()
    return torch.cat(chunks)


def run(rank, world_size):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "12363"
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=rank, world_size=world_size)
    device = torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(rank)
    x = torch.randn(12, device=device)
    mine = ring_allreduce(x.clone(), rank, world_size)
    reference = x.clone()
    dist.all_reduce(reference)
    batch = [dist.P2POp(dist.isend, x, (rank + 1) % world_size),
             dist.P2POp(dist.irecv, y := torch.zeros_like(x), (rank - 1) % world_size)]
    for req in dist.batch_isend_irecv(batch):
        req.wait()
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        print("RESULT " + json.dumps({"ring": mine.cpu().tolist(), "all_reduce": reference.cpu().tolist(),
                                      "from_left": y.cpu().tolist(),
                                      "same_on_all_ranks": all(torch.equal(g, mine) for g in gathered)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(3,), nprocs=3)
