"""test_cuda-, test_data_parallel- and test_nn-style tests, the parts the first files leave out: stream ordering
(wait_stream, wait_event, record_stream), stream priorities, the caching allocator's statistics, memory fraction and
out-of-memory, device properties, autocast's CUDA op lists, GradScaler's unscale, inf/NaN skip and scale update;
gradcheck through DataParallel, the device[0] check, no_grad and double backward in replicas, sparse gradients,
gather of scalars, autocast inside replicas, exceptions from a replica, saving replicas; and nn modules on CUDA
against the CPU, on emulated GPUs."""
import copy, io, unittest, torch, torch.nn as nn, torch.nn.functional as F
import torch.nn.parallel as dp
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_cuda import TEST_CUDA, TEST_MULTIGPU
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA, dtypes

@unittest.skipIf(not TEST_CUDA, "no cuda")
class TestCudaStreamsMemoryAmp(TestCase):
    def test_wait_stream_orders_work(self):
        s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s0):
            torch.cuda._sleep(int(50 * 1e6 / 1000))
            e = s0.record_event()
        s1.wait_event(e)
        self.assertFalse(s0.query())
        with torch.cuda.stream(s1):
            done = torch.cuda.Event(); done.record()
        done.synchronize()
        self.assertTrue(s0.query())
        s2 = torch.cuda.Stream()
        with torch.cuda.stream(s0):
            torch.cuda._sleep(int(50 * 1e6 / 1000))
        s2.wait_stream(s0)
        s2.synchronize()
        self.assertTrue(s0.query())

    def test_event_timing_and_wait(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(int(10 * 1e6 / 1000))
        end.record()
        end.synchronize()
        self.assertGreater(start.elapsed_time(end), 0)
        untimed = torch.cuda.Event()
        untimed.record(); untimed.synchronize()
        with self.assertRaises(ValueError):  # c10::ValueError since pytorch/pytorch#151404, as test_cuda.py expects
            start.elapsed_time(untimed)

    def test_stream_priority(self):
        low, high = torch.cuda.Stream.priority_range()
        self.assertGreaterEqual(low, high)
        s = torch.cuda.Stream(priority=high)
        self.assertEqual(s.priority, high)
        self.assertEqual(torch.cuda.Stream().priority, 0)

    @unittest.skipIf(not TEST_MULTIGPU, "one gpu")
    def test_stream_context_sets_device(self):
        s1 = torch.cuda.Stream(device=1)
        self.assertEqual(torch.cuda.current_device(), 0)
        with torch.cuda.stream(s1):
            self.assertEqual(torch.cuda.current_device(), 1)
            self.assertEqual(torch.cuda.current_stream(), s1)
            self.assertEqual(torch.ones(2, device="cuda").get_device(), 1)
        self.assertEqual(torch.cuda.current_device(), 0)
        self.assertEqual(torch.cuda.current_stream(1), torch.cuda.default_stream(1))

    def test_record_stream_then_free(self):
        # CUDACachingAllocator::free lowers allocated_bytes at once; only reuse of the block waits for the stream
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        side = torch.cuda.Stream()
        t = torch.zeros(1 << 20, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(50 * 1e6 / 1000))
            t.add_(1)
            total = t.sum()
        t.record_stream(side)
        total.record_stream(side)
        self.assertEqual(torch.cuda.memory_allocated() - base, 4 * (1 << 20) + 512)
        del t
        self.assertEqual(torch.cuda.memory_allocated() - base, 512)
        torch.cuda.current_stream().wait_stream(side)
        self.assertEqual(total.item(), float(1 << 20))

    def test_caching_allocator_stats(self):
        torch.cuda.empty_cache()
        base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        x = torch.empty(3 * 1024 * 1024 + 5, device="cuda", dtype=torch.uint8)
        self.assertGreaterEqual(torch.cuda.memory_allocated() - base_alloc, x.numel())
        self.assertEqual((torch.cuda.memory_allocated() - base_alloc) % 512, 0)
        self.assertGreaterEqual(torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
        del x
        self.assertEqual(torch.cuda.memory_allocated(), base_alloc)
        self.assertGreaterEqual(torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
        torch.cuda.empty_cache()
        self.assertEqual(torch.cuda.memory_reserved(), base_reserved)
        stats = torch.cuda.memory_stats()
        for key in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "active_bytes.all.current",
                    "num_alloc_retries", "num_ooms"):
            self.assertIn(key, stats)
        self.assertEqual(stats["allocated_bytes.all.current"], torch.cuda.memory_allocated())
        self.assertIn("Allocated memory", torch.cuda.memory_summary())

    def test_memory_fraction_and_oom(self):
        total = torch.cuda.get_device_properties(0).total_memory
        free, total_info = torch.cuda.mem_get_info()
        self.assertEqual(total_info, total)
        self.assertLessEqual(free, total)
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        try:
            with self.assertRaisesRegex(torch.cuda.OutOfMemoryError, "out of memory"):
                torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
            ok = torch.empty(int(total * 0.1), dtype=torch.uint8, device="cuda")
            del ok
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()

    def test_device_properties(self):
        props = torch.cuda.get_device_properties(0)
        self.assertEqual(torch.cuda.get_device_name(0), props.name)
        self.assertEqual(torch.cuda.get_device_capability(0), (props.major, props.minor))
        self.assertGreater(props.multi_processor_count, 0)
        self.assertEqual(torch.cuda.get_device_properties("cuda:0").name, props.name)

    def test_autocast_op_lists(self):
        a, b = torch.randn(8, 8, device="cuda"), torch.randn(8, 8, device="cuda")
        with torch.autocast("cuda"):
            self.assertTrue(torch.is_autocast_enabled("cuda"))
            self.assertEqual(torch.get_autocast_dtype("cuda"), torch.float16)
            mm = a @ b
            self.assertEqual(mm.dtype, torch.float16)  # lower_precision_fp list
            self.assertEqual(torch.softmax(mm, 0).dtype, torch.float32)  # fp32 list
            self.assertEqual(torch.log_softmax(mm, 1).dtype, torch.float32)
            self.assertEqual((mm + a).dtype, torch.float32)  # promote list
            self.assertEqual(torch.cat([mm, a]).dtype, torch.float32)
            self.assertEqual(torch.relu(mm).dtype, torch.float16)  # not listed: runs in its input's dtype
            self.assertEqual(nn.functional.linear(a, b).dtype, torch.float16)
            with torch.autocast("cuda", enabled=False):
                self.assertEqual((a @ b).dtype, torch.float32)
            self.assertEqual((a.cpu() @ b.cpu()).dtype, torch.float32)  # CPU autocast is separate
        self.assertEqual(mm.float().cpu(), (a.cpu().half() @ b.cpu().half()).float(), atol=1e-2, rtol=1e-2)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            self.assertEqual((a @ b).dtype, torch.bfloat16)
            self.assertEqual(nn.functional.mse_loss(a @ b, b).dtype, torch.float32)

    def test_autocast_backward_grads_are_fp32(self):
        torch.manual_seed(0)
        m = nn.Linear(8, 4).cuda()
        x = torch.randn(3, 8, device="cuda")
        with torch.autocast("cuda"):
            out = m(x)
        out.float().sum().backward()
        self.assertEqual(m.weight.grad.dtype, torch.float32)
        ref = x.cpu().half().float().sum(0).expand(4, 8)
        self.assertEqual(m.weight.grad.cpu(), ref, atol=1e-2, rtol=1e-2)

    def test_grad_scaler_unscale_and_skip(self):
        torch.manual_seed(0)
        m = nn.Linear(4, 2).cuda()
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cuda", init_scale=4.0, growth_factor=2.0, backoff_factor=0.5,
                                      growth_interval=1)
        x = torch.randn(3, 4, device="cuda")
        loss = m(x).sum()
        scaler.scale(loss).backward()
        self.assertEqual(m.bias.grad.cpu(), torch.full((2,), 12.0))  # 3 rows, scaled by 4
        scaler.unscale_(opt)
        self.assertEqual(m.bias.grad.cpu(), torch.full((2,), 3.0))
        before = m.bias.detach().clone()
        scaler.step(opt); scaler.update()
        self.assertEqual(m.bias.detach().cpu(), (before - 3.0).cpu())
        self.assertEqual(scaler.get_scale(), 8.0)
        opt.zero_grad()
        (scaler.scale(m(x).sum()) * float("inf")).backward()
        kept = [p.detach().clone() for p in m.parameters()]
        scaler.step(opt); scaler.update()
        for p, k in zip(m.parameters(), kept):
            self.assertEqual(p, k)  # step skipped
        self.assertEqual(scaler.get_scale(), 4.0)
        self.assertEqual(scaler._scale.device, torch.device("cuda:0"))

    def test_amp_foreach_non_finite_check(self):
        grads = [torch.tensor([2.0, 4.0], device="cuda"), torch.tensor([float("nan")], device="cuda")]
        found = torch.zeros(1, device="cuda")
        inv = torch.full((1,), 0.5, device="cuda")
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        self.assertEqual(found.item(), 1.0)
        self.assertEqual(grads[0].cpu(), torch.tensor([1.0, 2.0]))


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


class TestNNDeviceType(TestCase):
    @onlyCUDA
    def test_batchnorm_forward_backward_running_stats(self, device):
        torch.manual_seed(0)
        bn_cpu = nn.BatchNorm2d(3)
        bn_dev = copy.deepcopy(bn_cpu).to(device)
        x = torch.randn(4, 3, 5, 5)
        x_cpu, x_dev = x.clone().requires_grad_(), x.to(device).requires_grad_()
        out_cpu, out_dev = bn_cpu(x_cpu), bn_dev(x_dev)
        self.assertEqual(out_dev.cpu(), out_cpu, atol=1e-5, rtol=1e-5)
        out_cpu.pow(2).sum().backward(); out_dev.pow(2).sum().backward()
        self.assertEqual(x_dev.grad.cpu(), x_cpu.grad, atol=1e-5, rtol=1e-5)
        self.assertEqual(bn_dev.weight.grad.cpu(), bn_cpu.weight.grad, atol=1e-5, rtol=1e-5)
        self.assertEqual(bn_dev.running_mean.cpu(), bn_cpu.running_mean)
        self.assertEqual(bn_dev.running_var.cpu(), bn_cpu.running_var)
        self.assertEqual(bn_dev.num_batches_tracked.item(), 1)

    @onlyCUDA
    def test_embedding_bag_per_sample_weights(self, device):
        self.device = device
        torch.manual_seed(0)
        bag = nn.EmbeddingBag(10, 4, mode="sum")
        idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
        weights = torch.rand(8)
        out_cpu = bag(idx, offsets, per_sample_weights=weights)
        bag_dev = copy.deepcopy(bag).to(device)
        out_dev = bag_dev(idx.to(device), offsets.to(device), per_sample_weights=weights.to(device))
        self.assertEqual(out_dev.cpu(), out_cpu)
        out_cpu.sum().backward(); out_dev.sum().backward()
        self.assertEqual(bag_dev.weight.grad.cpu(), bag.weight.grad)

    @onlyCUDA
    def test_ctc_loss_matches_cpu(self, device):
        torch.manual_seed(0)
        log_probs = torch.randn(12, 2, 6).log_softmax(2)
        targets = torch.randint(1, 6, (2, 5), dtype=torch.long)
        in_len, tgt_len = torch.tensor([12, 10]), torch.tensor([5, 3])
        lp_cpu = log_probs.clone().requires_grad_()
        lp_dev = log_probs.to(device).requires_grad_()
        loss_cpu = F.ctc_loss(lp_cpu, targets, in_len, tgt_len)
        loss_dev = F.ctc_loss(lp_dev, targets.to(device), in_len.to(device), tgt_len.to(device))
        self.assertEqual(loss_dev.cpu(), loss_cpu, atol=1e-5, rtol=1e-5)
        loss_cpu.backward(); loss_dev.backward()
        self.assertEqual(lp_dev.grad.cpu(), lp_cpu.grad, atol=1e-5, rtol=1e-5)

    @onlyCUDA
    @dtypes(torch.float, torch.half)
    def test_interpolate_and_grid_sample(self, device, dtype):
        torch.manual_seed(0)
        x = torch.randn(2, 3, 6, 6)
        grid = torch.rand(2, 4, 4, 2) * 2 - 1
        tol = 1e-5 if dtype == torch.float else 2e-3
        up = F.interpolate(x.to(device, dtype), scale_factor=2, mode="bilinear", align_corners=False)
        self.assertEqual(up.dtype, dtype)
        self.assertEqual(up.float().cpu(), F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
                         atol=tol, rtol=tol)
        sampled = F.grid_sample(x.to(device), grid.to(device), align_corners=False)
        self.assertEqual(sampled.cpu(), F.grid_sample(x, grid, align_corners=False), atol=1e-5, rtol=1e-5)

    @onlyCUDA
    def test_cross_entropy_label_smoothing_and_ignore_index(self, device):
        torch.manual_seed(0)
        logits, target = torch.randn(8, 5), torch.randint(0, 5, (8,))
        target[2] = -100
        for kwargs in ({}, {"label_smoothing": 0.1}, {"reduction": "sum", "weight": torch.rand(5)}):
            dev_kwargs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
            got = F.cross_entropy(logits.to(device), target.to(device), **dev_kwargs)
            self.assertEqual(got.cpu(), F.cross_entropy(logits, target, **kwargs), atol=1e-5, rtol=1e-5)


instantiate_device_type_tests(TestNNDeviceType, globals())

if __name__ == "__main__":
    run_tests()
