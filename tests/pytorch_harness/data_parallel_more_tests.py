"""test_data_parallel-style TestCase, the cases the first file leaves out: gradcheck through DataParallel, the
device[0] check, no_grad and double backward in replicas, sparse gradients, gather of scalars, autocast inside
replicas, exceptions from a replica, and saving replicas, on emulated GPUs."""
import io, unittest, warnings, torch, torch.nn as nn
import torch.nn.parallel as dp
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_cuda import TEST_MULTIGPU

@unittest.skipIf(not TEST_MULTIGPU, "multi-GPU not supported")
class TestDataParallelMore(TestCase):
    def test_buffer_requiring_grad_gradcheck(self):
        class Scale(nn.Module):
            def __init__(self, t):
                super().__init__()
                self.register_buffer("w", t)
                self.register_buffer("b", t.detach().clone())
            def forward(self, x):
                return x * self.w + self.b
        m = Scale(torch.randn(6, device="cuda", dtype=torch.double, requires_grad=True))
        dpm = nn.DataParallel(m, [0, 1])
        x = torch.randn(4, 6, device="cuda", dtype=torch.double)
        self.assertTrue(torch.autograd.gradcheck(lambda w: dpm(x), (m.w,)))

    def test_module_device_check(self):
        lin = nn.Linear(2, 2)
        x0 = torch.randn(2, 2, device="cuda:0")
        msg = "module must have its parameters and buffers on device cuda:{}"
        with self.assertRaisesRegex(RuntimeError, msg.format(0)):
            nn.DataParallel(lin.cuda(1))(x0)
        with self.assertRaisesRegex(RuntimeError, msg.format(1)):
            dp.data_parallel(lin.cuda(0), x0, [1, 0])
        self.assertEqual(dp.data_parallel(lin.cuda(1), x0.cuda(1), [1, 0]), lin(x0.cuda(1)))

    def test_no_grad_in_replicas(self):
        seen = []
        class Probe(nn.Module):
            def forward(self, x):
                seen.append(torch.is_grad_enabled())
                return x
        x = torch.randn(6, 3, device="cuda")
        with torch.no_grad():
            dp.data_parallel(Probe(), x, (0, 1))
        self.assertEqual(seen, [False, False])
        dp.data_parallel(Probe(), x, (0, 1))
        self.assertEqual(seen[2:], [True, True])

    def test_double_backward_through_replicas(self):
        net = nn.Linear(4, 1).cuda()
        dpn = nn.DataParallel(net, [0, 1])
        x = torch.ones(2, 4, requires_grad=True).cuda()
        out = dpn(x)
        g = torch.autograd.grad(out, x, grad_outputs=x.new_ones(out.size()), create_graph=True)[0]
        g.mean().backward()
        self.assertEqual(net.weight.grad, torch.full((1, 4), 0.25, device="cuda:0"))
        self.assertEqual(net.bias.grad, torch.zeros(1, device="cuda:0"))

    def test_sparse_embedding_grads(self):
        emb = nn.Embedding(10, 5, sparse=True).to("cuda:1")
        idx = torch.randint(10, (20, 5), device="cuda:1")
        expected = emb(idx)
        expected.sum().backward()
        expected_grad = emb.weight.grad.to_dense().clone()
        for ids in [(0, 1), (1, 0)]:
            with torch.cuda.device(ids[0]):
                emb.cuda(); emb.zero_grad()
                out = dp.data_parallel(emb, idx, ids)
                out.sum().backward()
                self.assertEqual(out.get_device(), ids[0])
                self.assertEqual(out, expected)
                self.assertTrue(emb.weight.grad.is_sparse)
                self.assertEqual(emb.weight.grad.to_dense(), expected_grad)

    def test_gather_scalars_and_backward(self):
        for target in (0, -1):
            a = torch.randn((), device="cuda:0", requires_grad=True)
            b = torch.randn((), device="cuda:1", requires_grad=True)
            out = dp.gather((a, b), target)
            self.assertEqual(out.shape, torch.Size([2]))
            self.assertEqual(out.is_cuda, target != -1)
            self.assertEqual(out.cpu(), torch.stack([a.cpu(), b.cpu()]))
            grad = torch.tensor([2.0, 3.0], device=out.device)
            out.backward(grad)
            self.assertEqual((a.grad.item(), b.grad.item()), (2.0, 3.0))
            self.assertEqual(b.grad.get_device(), 1)
        with self.assertRaises(ValueError):
            dp.gather(({"a": torch.ones(1, device="cuda:0")},
                       {"a": torch.ones(1, device="cuda:1"), "b": torch.ones(1, device="cuda:1")}), 0)

    def test_autocast_inside_replicas(self):
        class Model(nn.Linear):
            def __init__(self):
                super().__init__(8, 8)
            @torch.autocast("cuda")
            def forward(self, x):
                return super().forward(x)
        m = Model().cuda()
        x = torch.randn(8, 8, device="cuda")
        out = nn.DataParallel(m)(x)
        self.assertIs(out.dtype, torch.float16)
        self.assertEqual(out.float(), (x.half() @ m.weight.half().t() + m.bias.half()).float(), atol=2e-3, rtol=2e-3)
        l1, l2 = nn.Linear(10, 5).cuda(0), nn.Linear(10, 5).cuda(1)
        i1, i2 = torch.randn(2, 10, device="cuda:0"), torch.randn(2, 10, device="cuda:1")
        with torch.autocast("cuda"):
            outs = dp.parallel_apply((l1, l2), (i1, i2))
        self.assertEqual([o.dtype for o in outs], [torch.float16, torch.float16])
        self.assertEqual([o.get_device() for o in outs], [0, 1])

    def test_parallel_apply_passes_exception(self):
        class Bad(nn.Module):
            def forward(self, *args):
                return {}["wonderful"]
        bad = Bad().cuda()
        with self.assertRaisesRegex(KeyError, r"Caught KeyError in replica \d on device 0.\nOriginal Traceback[\s\S]+wonderful"):
            dp.parallel_apply(modules=(bad, bad), inputs=(None, None))

    def test_zero_grad_warns_in_replica(self):
        test = self
        class Net(nn.Module):
            def forward(self, x):
                with test.assertWarnsRegex(UserWarning, r"Calling \.zero_grad\(\) from a module created with nn\.DataParallel\(\) has no effect"):
                    self.zero_grad()
                return x
        nn.DataParallel(Net().cuda())(torch.rand(4, 3, device="cuda"))

    def test_save_and_load_replicas(self):
        module = nn.Linear(8, 8).cuda()
        for detach in (False, True):
            replicas = dp.replicate(module, devices=[0, 1], detach=detach)
            buf = io.BytesIO()
            torch.save(replicas, buf)
            buf.seek(0)
            loaded = torch.load(buf, weights_only=False)
            self.assertEqual([r.weight.get_device() for r in loaded], [0, 1])
            self.assertEqual(loaded[1].weight.cpu(), module.weight.cpu())

    def test_channels_last_half_grads_match_single_gpu(self):
        torch.manual_seed(0)
        conv = nn.Sequential(nn.Conv2d(4, 8, 2), nn.Conv2d(8, 4, 2)).cuda().to(memory_format=torch.channels_last)
        copy = nn.Sequential(nn.Conv2d(4, 8, 2), nn.Conv2d(8, 4, 2)).cuda()
        copy.load_state_dict(conv.state_dict())
        copy = nn.DataParallel(copy.to(memory_format=torch.channels_last), device_ids=[0, 1])
        x = torch.randn(4, 4, 6, 6, device="cuda")
        conv(x).pow(2).mean().backward()
        copy(x).pow(2).mean().backward()
        for p, q in zip(conv.parameters(), copy.module.parameters()):
            self.assertEqual(p.grad, q.grad, atol=1e-5, rtol=1e-5)
        self.assertTrue(copy.module[0].weight.grad.is_contiguous(memory_format=torch.channels_last))

if __name__ == "__main__":
    run_tests()
