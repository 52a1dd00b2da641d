"""test_c10d_gloo- and FSDP2-style tests (MultiProcessTestCase, FSDPTest): gloo collectives on CUDA tensors, DDP
and a DTensor over gloo, and fully_shard's training parity, sharded parameters and mixed precision, two ranks on
emulated GPUs."""
import copy, torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_distributed import MultiProcessTestCase, skip_if_lt_x_gpu, requires_gloo
from torch.testing._internal.common_fsdp import FSDPTest, MLP
from torch.testing._internal.common_utils import run_tests


class GlooCudaTest(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
    @property
    def world_size(self): return 2
    @requires_gloo()
    @skip_if_lt_x_gpu(2)
    def test_gloo_collectives_on_cuda_tensors_and_ddp(self):  # one test: each spawns its processes
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        dev = torch.device("cuda", self.rank)
        for op, want in [(dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.MAX, 2.0), (dist.ReduceOp.PRODUCT, 2.0)]:
            t = torch.full((3,), float(self.rank + 1), device=dev)
            dist.all_reduce(t, op=op)
            self.assertEqual(t, torch.full((3,), want, device=dev))
            self.assertEqual(t.device, dev)
        b = torch.arange(4.0, device=dev) + 10 * self.rank
        dist.broadcast(b, src=1)
        self.assertEqual(b.cpu(), torch.arange(4.0) + 10)
        outs = [torch.zeros(2, 2, device=dev) for _ in range(2)]
        dist.all_gather(outs, torch.full((2, 2), float(self.rank), device=dev))
        self.assertEqual(torch.stack(outs).cpu(), torch.stack([torch.zeros(2, 2), torch.ones(2, 2)]))
        work = dist.all_reduce(torch.ones(5, device=dev), async_op=True)
        work.wait()
        self.assertTrue(work.is_completed())
        torch.manual_seed(0)
        m = nn.Linear(5, 3).to(self.rank)
        ref = copy.deepcopy(m).cpu()
        ddp = DDP(m, device_ids=[self.rank])
        torch.manual_seed(1)
        xs = torch.randn(2, 4, 5)
        ddp(xs[self.rank].to(self.rank)).pow(2).sum().backward()
        ref(xs.reshape(8, 5)).pow(2).sum().div(2).backward()
        self.assertEqual(m.weight.grad.cpu(), ref.weight.grad)
        self.assertEqual(m.bias.grad.device, dev)
        # a DTensor on a cuda mesh over the gloo group: its device is its shard's GPU, values as sharded
        mesh = init_device_mesh("cuda", (self.world_size,))
        full = torch.arange(12.0).view(4, 3)
        d = distribute_tensor(full.to(dev), mesh, [Shard(0)])
        self.assertIsInstance(d, DTensor)
        self.assertEqual(d.device, dev)
        self.assertEqual(d.to_local().cpu(), full.chunk(self.world_size)[self.rank])
        self.assertEqual(d.full_tensor().cpu(), full)
        # DDP's reducer and the async work hold the gloo group: dropped after destroy_process_group, the group's
        # destructor hung the process in 1 of 5 runs here, with plain CPU torch too (no emulator)
        del ddp, work
        dist.destroy_process_group()


class FullyShardTrainTest(FSDPTest):
    @property
    def world_size(self): return 2
    @skip_if_lt_x_gpu(2)
    def test_train_parity_and_mixed_precision(self):  # one test: each spawns its processes
        torch.manual_seed(42)
        model = nn.Sequential(MLP(8, torch.device("cuda")), MLP(8, torch.device("cuda")))
        ref = copy.deepcopy(model)
        for mlp in model:
            fully_shard(mlp)
        fully_shard(model)
        for p, r in zip(model.parameters(), ref.parameters()):
            self.assertIsInstance(p, DTensor)
            self.assertEqual(p.placements, (Shard(0),))
            self.assertEqual(p.device, torch.device("cuda", self.rank))
            self.assertEqual(p.to_local(), r.chunk(self.world_size)[self.rank].to(self.rank))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for step in range(3):
            torch.manual_seed(step)
            xs = torch.randn(self.world_size, 4, 8, device="cuda")
            loss = model(xs[self.rank]).sum()
            loss.backward()
            ref_loss = ref(xs.flatten(0, 1)).sum() / self.world_size  # FSDP averages gradients across ranks
            ref_loss.backward()
            opt.step(); ref_opt.step()
            opt.zero_grad(); ref_opt.zero_grad()
            losses = [torch.zeros((), device="cuda") for _ in range(self.world_size)]
            dist.all_gather(losses, loss.detach())
            self.assertEqual(sum(losses) / self.world_size, ref_loss)
        for p, r in zip(model.parameters(), ref.parameters()):
            self.assertEqual(p.full_tensor(), r)
        torch.manual_seed(7)
        mp_model = copy.deepcopy(ref)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for mlp in mp_model:
            fully_shard(mlp, mp_policy=policy)
        fully_shard(mp_model, mp_policy=policy)
        x = torch.randn(4, 8, device="cuda")
        out = mp_model(x)
        self.assertEqual(out.dtype, torch.bfloat16)
        ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
        self.assertEqual(out, ref_bf16(x.to(torch.bfloat16)))
        out.float().sum().backward()
        for p in mp_model.parameters():
            self.assertEqual(p.dtype, torch.float32)
            self.assertEqual(p.grad.dtype, torch.float32)


if __name__ == "__main__":
    run_tests()
