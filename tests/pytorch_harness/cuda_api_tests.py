"""test_cuda-style TestCase: streams, events, non-blocking copies, serialization with storages, RNG state, TF32 flags,
device mismatch errors, memory statistics, on emulated GPUs."""
import io, unittest, torch
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_cuda import TEST_CUDA, TEST_MULTIGPU

@unittest.skipIf(not TEST_CUDA, "no cuda")
class TestCudaStyle(TestCase):
    def test_streams(self):
        default_stream = torch.cuda.current_stream()
        user_stream = torch.cuda.Stream()
        self.assertEqual(torch.cuda.current_stream(), default_stream)
        self.assertNotEqual(default_stream, user_stream)
        self.assertEqual(default_stream.cuda_stream, 0)
        self.assertNotEqual(user_stream.cuda_stream, 0)
        with torch.cuda.stream(user_stream):
            self.assertEqual(torch.cuda.current_stream(), user_stream)
        self.assertTrue(user_stream.query())
        tensor1 = torch.ByteTensor(5).pin_memory()
        default_stream.synchronize()
        self.assertTrue(default_stream.query())

    def test_stream_event_repr(self):
        s = torch.cuda.current_stream()
        self.assertTrue("torch.cuda.Stream" in s.__repr__())
        e = torch.cuda.Event()
        self.assertTrue("torch.cuda.Event" in e.__repr__())
        s.record_event(e)
        self.assertTrue("torch.cuda.Event" in e.__repr__())

    def test_events(self):
        stream = torch.cuda.current_stream()
        event = torch.cuda.Event(enable_timing=True)
        self.assertTrue(event.query())
        start_event = torch.cuda.Event(enable_timing=True)
        stream.record_event(start_event)
        torch.cuda._sleep(int(50 * 1e6 / 1000))
        stream.record_event(event)
        self.assertFalse(event.query())
        event.synchronize()
        self.assertTrue(event.query())
        self.assertGreater(start_event.elapsed_time(event), 0)

    def test_copy_non_blocking(self):
        def _test_copy_non_blocking(a, b):
            event = torch.cuda.Event()
            a.copy_(b, non_blocking=True)
            event.record()
            event.synchronize()
            self.assertEqual(a, b)
        x = torch.ones(10000000, dtype=torch.uint8).cuda()
        y = torch.zeros(10000000, dtype=torch.uint8).pin_memory()
        _test_copy_non_blocking(x, y)
        x = torch.zeros(10000000, dtype=torch.uint8).pin_memory()
        y = torch.ones(10000000, dtype=torch.uint8).cuda()
        _test_copy_non_blocking(x, y)

    def test_to_non_blocking(self):
        stream = torch.cuda.current_stream()
        def _test_to_non_blocking(a, non_blocking, dst):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(100 * 1e6 / 1000))
            b = a.to(device=dst, non_blocking=non_blocking)
            self.assertEqual(stream.query(), not non_blocking)
            stream.synchronize()
            self.assertEqual(a, b)
            self.assertTrue(b.is_pinned() == (non_blocking and dst == "cpu"))
        for dst, try_non_blocking in [("cuda", True), ("cpu", True), ("cpu", False)]:
            src = torch.randn(1000000, device="cuda" if dst == "cpu" else "cpu", pin_memory=True if dst == "cuda" else False)
            _test_to_non_blocking(src, try_non_blocking, dst)

    def test_serialization_array_with_storage(self):
        x = torch.randn(5, 5).cuda()
        y = torch.IntTensor(2, 5).fill_(0).cuda()
        q = [x, y, x, y.storage()]
        f = io.BytesIO()
        torch.save(q, f)
        f.seek(0)
        q_copy = torch.load(f)
        self.assertEqual(q_copy, q, atol=0, rtol=0)
        q_copy[0].fill_(5)
        self.assertEqual(q_copy[0], q_copy[2], atol=0, rtol=0)
        self.assertTrue(isinstance(q_copy[0], torch.cuda.FloatTensor))
        self.assertTrue(isinstance(q_copy[1], torch.cuda.IntTensor))
        self.assertTrue(isinstance(q_copy[2], torch.cuda.FloatTensor))
        self.assertTrue(isinstance(q_copy[3], torch.storage.TypedStorage))
        self.assertTrue(isinstance(q_copy[3]._untyped_storage, torch.UntypedStorage))
        q_copy[1].fill_(10)
        self.assertEqual(q_copy[3].tolist(), [10] * 10)

    def test_manual_seed_and_rng_state(self):
        torch.cuda.manual_seed(2)
        x = torch.cuda.FloatTensor(10).normal_()
        state = torch.cuda.get_rng_state()
        y = torch.cuda.FloatTensor(10).normal_()
        torch.cuda.set_rng_state(state)
        z = torch.cuda.FloatTensor(10).normal_()
        self.assertEqual(y, z)
        self.assertEqual(torch.cuda.initial_seed(), 2)

    def test_cublas_allow_tf32_get_set(self):
        orig = torch.backends.cuda.matmul.allow_tf32
        self.assertEqual(torch._C._get_cublas_allow_tf32(), orig)
        torch.backends.cuda.matmul.allow_tf32 = not orig
        self.assertEqual(torch._C._get_cublas_allow_tf32(), not orig)
        torch.backends.cuda.matmul.allow_tf32 = orig

    def test_matmul_device_mismatch(self):
        cpu = torch.rand((10, 10))
        cuda = cpu.cuda()
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            cpu @ cuda
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            cuda @ cpu
        for s, m1, m2 in [(cpu, cuda, cuda), (cuda, cpu, cuda), (cuda, cuda, cpu)]:
            with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
                torch.addmm(s, m1, m2)

    def test_memory_stats_and_leak(self):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        x = torch.empty(1024, 1024, device="cuda")
        self.assertEqual(torch.cuda.memory_allocated() - before, 4 * 1024 * 1024)
        self.assertGreaterEqual(torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated())
        del x
        self.assertEqual(torch.cuda.memory_allocated(), before)
        stats = torch.cuda.memory_stats()
        self.assertIn("allocated_bytes.all.peak", stats)
        torch.cuda.reset_peak_memory_stats()
        self.assertEqual(torch.cuda.max_memory_allocated(), before)

    @unittest.skipIf(not TEST_MULTIGPU, "one gpu")
    def test_cuda_set_device_and_cross_copy(self):
        x = torch.randn(5, 5).cuda()
        with torch.cuda.device(1):
            y = torch.randn(5, 5).cuda()
            self.assertEqual(y.get_device(), 1)
            z = x.to(y.device)
            self.assertEqual(z.get_device(), 1)
            self.assertEqual(z.cpu(), x.cpu())
        torch.cuda.set_device(1)
        self.assertEqual(torch.randn(1, device="cuda").get_device(), 1)
        torch.cuda.set_device(0)

if __name__ == "__main__":
    run_tests()
