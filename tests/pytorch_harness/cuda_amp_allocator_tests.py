"""test_cuda-style TestCase, the parts the first file leaves out: stream ordering (wait_stream, wait_event,
record_stream), stream priorities, the caching allocator's statistics, memory fraction and out-of-memory, device
properties, autocast's CUDA op lists, and GradScaler's unscale, inf/NaN skip and scale update, on emulated GPUs."""
import unittest, torch, torch.nn as nn
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_cuda import TEST_CUDA, TEST_MULTIGPU

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
        with self.assertRaises(RuntimeError):
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

if __name__ == "__main__":
    run_tests()
