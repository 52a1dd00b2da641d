"""MultiThreadedTestCase- and FSDPTestMultiThread-style tests (PyTorch's "threaded" world, one thread per rank):
collectives on CUDA tensors, each rank's own random numbers, and fully_shard's training parity with a replicated model, two ranks on emulated GPUs."""
import copy, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_distributed import MultiThreadedTestCase, skip_if_lt_x_gpu
from torch.testing._internal.common_fsdp import FSDPTestMultiThread, MLP
from torch.testing._internal.common_utils import run_tests


class ThreadedCollectivesTest(MultiThreadedTestCase):
    @property
    def world_size(self): return 2
    def setUp(self):
        super().setUp()
        self._spawn_threads()
    @skip_if_lt_x_gpu(2)
    def test_all_reduce_all_gather_broadcast_on_cuda(self):
        dev = torch.device("cuda", self.rank)
        for op, want in [(dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.MAX, 2.0), (dist.ReduceOp.PRODUCT, 2.0)]:
            t = torch.full((3,), float(self.rank + 1), device=dev)
            dist.all_reduce(t, op=op)
            self.assertEqual(t.device, dev)
            self.assertEqual(t.cpu(), torch.full((3,), want))
        outs = [torch.empty(2, 2, device=dev) for _ in range(self.world_size)]
        dist.all_gather(outs, torch.full((2, 2), float(self.rank), device=dev))
        self.assertEqual(torch.stack(outs).cpu(), torch.stack([torch.zeros(2, 2), torch.ones(2, 2)]))
        b = torch.arange(4.0, device=dev) + 10 * self.rank
        dist.broadcast(b, src=1)
        self.assertEqual(b.cpu(), torch.arange(4.0) + 10)
    @skip_if_lt_x_gpu(2)
    def test_each_rank_thread_draws_from_its_own_generator(self):
        dev = torch.device("cuda", self.rank)
        torch.manual_seed(self.rank)
        dist.all_reduce(torch.zeros(1, device=dev))  # every rank has seeded before any draws
        drawn = torch.cat([nn.Linear(4, 4).to(dev).weight.flatten(), torch.randn(8, device=dev)])
        outs = [torch.empty_like(drawn) for _ in range(self.world_size)]
        dist.all_gather(outs, drawn)
        for rank, got in enumerate(outs):
            torch.manual_seed(rank)  # as rank processes, each seeded with its rank, would draw
            self.assertEqual(got.cpu(), torch.cat([nn.Linear(4, 4).weight.flatten(), torch.randn(8)]), msg=f"rank {rank}")


class ThreadedFSDP2Test(FSDPTestMultiThread):
    @property
    def world_size(self): return 2
    @skip_if_lt_x_gpu(2)
    def test_fully_shard_trains_as_the_replicated_model(self):
        torch.cuda.set_device(self.rank)
        torch.manual_seed(42)
        model = MLP(8, torch.device("cuda"))  # the same weights on every rank: each rank thread has its own generator
        ref = copy.deepcopy(model)
        mesh = init_device_mesh("cuda", (self.world_size,))
        fully_shard(model.in_proj, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
        torch.manual_seed(self.rank + 1)
        for _ in range(3):
            x = torch.randn(4, 8, device="cuda")
            ref(x).sum().backward()
            for p in ref.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(self.world_size)
            model(x).sum().backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            self.assertEqual(p.full_tensor().cpu(), r.detach().cpu(), msg=name)
            self.assertEqual(p.to_local().device, torch.device("cuda", self.rank))


if __name__ == "__main__":
    run_tests()
