"""MultiProcessTestCase-style (c10d tests): collectives on nccl and DDP gradients, two spawned ranks."""
import os, sys, torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, skip_if_lt_x_gpu, requires_nccl
from torch.testing._internal.common_utils import run_tests
from torch.nn.parallel import DistributedDataParallel as DDP

class NCCLStyleTest(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
    @property
    def world_size(self): return 2
    def _init(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("nccl", store=store, rank=self.rank, world_size=self.world_size)
        torch.cuda.set_device(self.rank)
    @requires_nccl()
    @skip_if_lt_x_gpu(2)
    def test_collectives_and_ddp(self):  # one test: each spawns its processes
        self._init()
        t = torch.full((4,), float(self.rank + 1), device=f"cuda:{self.rank}")
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((4,), 3.0, device=f"cuda:{self.rank}"))
        b = torch.arange(3.0, device="cuda") * (self.rank + 1)
        dist.broadcast(b, src=1)
        self.assertEqual(b.cpu(), torch.arange(3.0) * 2)
        outs = [torch.empty(2, device="cuda") for _ in range(2)]
        dist.all_gather(outs, torch.full((2,), float(self.rank), device="cuda"))
        self.assertEqual([o.sum().item() for o in outs], [0.0, 2.0])
        # DDP's averaged gradients equal those of one model on the whole batch
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2).cuda(self.rank)
        ref = torch.nn.Linear(4, 2); ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
        ddp = DDP(m, device_ids=[self.rank])
        torch.manual_seed(10)
        xs = torch.randn(2, 3, 4)
        ddp(xs[self.rank].cuda(self.rank)).sum().backward()
        ref(xs.view(6, 4)).sum().div(2).backward()
        self.assertEqual(m.weight.grad.cpu(), ref.weight.grad)
        dist.destroy_process_group()

if __name__ == "__main__":
    run_tests()
