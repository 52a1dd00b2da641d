"""test_cuda_multigpu-style TestCase and device-type tests (instantiate_device_type_tests) on emulated GPUs."""
import unittest, torch, torch.nn as nn
from torch.testing._internal.common_utils import TestCase, run_tests, NoTest, skipIfRocm
from torch.testing._internal.common_cuda import TEST_CUDA, TEST_MULTIGPU, TEST_CUDNN, SM80OrLater, PLATFORM_SUPPORTS_BF16, tf32_on_and_off
from torch.testing._internal.common_device_type import (instantiate_device_type_tests, onlyCUDA, deviceCountAtLeast,
    dtypes, largeTensorTest, dtypesIfCUDA, precisionOverride, skipCUDAIfNoCudnn, onlyNativeDeviceTypes)

class TestMultiGPU(TestCase):
    @unittest.skipIf(not TEST_MULTIGPU, "only one GPU detected")
    def test_copy_between_devices(self):
        x = torch.randn(5, 5, device="cuda:0")
        with torch.cuda.device(1):
            y = x.cuda()
            self.assertEqual(y.get_device(), 1)
            self.assertIs(y.cuda(), y)
            z = y.cuda(0)
            self.assertEqual(z.get_device(), 0)
        self.assertEqual(x, z)

    @unittest.skipIf(not TEST_MULTIGPU, "only one GPU detected")
    def test_streams_multi_gpu(self):
        default_stream = torch.cuda.current_stream()
        self.assertEqual(default_stream.device, torch.device("cuda:0"))
        stream = torch.cuda.Stream(device=1)
        self.assertEqual(stream.device, torch.device("cuda:1"))
        with torch.cuda.device(1):
            self.assertEqual(torch.cuda.current_stream().device, torch.device("cuda:1"))
            self.assertNotEqual(torch.cuda.current_stream(), default_stream)

    @unittest.skipIf(not TEST_MULTIGPU, "only one GPU detected")
    def test_events_multi_gpu_elapsed_time(self):
        with torch.cuda.device(0):
            e0 = torch.cuda.Event(enable_timing=True); e0.record()
        with torch.cuda.device(1):
            e1 = torch.cuda.Event(enable_timing=True); e1.record()
        e0.synchronize(); e1.synchronize()
        with torch.cuda.device(0):
            with self.assertRaises(RuntimeError):
                self.assertGreater(e0.elapsed_time(e1), 0)

    @unittest.skipIf(not TEST_CUDA, "CUDA not available")
    def test_cuda_tensor_meta(self):
        x = torch.zeros(3, device="cuda", dtype=torch.half)
        self.assertTrue(x.is_cuda)
        self.assertEqual(x.type(), "torch.cuda.HalfTensor")
        self.assertIsInstance(x, torch.cuda.HalfTensor)
        self.assertNotIsInstance(x, torch.HalfTensor)
        self.assertEqual(x.untyped_storage().device.type, "cuda")

class TestDeviceGeneric(TestCase):
    @onlyCUDA
    @deviceCountAtLeast(2)
    def test_cross_device_ops(self, devices):
        a = torch.ones(3, device=devices[0]); b = torch.ones(3, device=devices[1])
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            a + b
        self.assertEqual((a + b.to(devices[0])).sum().item(), 6)

    @dtypes(torch.float, torch.double)
    @dtypesIfCUDA(torch.float, torch.half, torch.bfloat16)
    def test_matmul_matches_cpu(self, device, dtype):
        torch.manual_seed(0)
        a = torch.randn(16, 8, dtype=torch.float32); b = torch.randn(8, 4, dtype=torch.float32)
        got = (a.to(device, dtype) @ b.to(device, dtype)).float().cpu()
        self.assertEqual(got, (a.to(dtype) @ b.to(dtype)).float(), atol=1e-2, rtol=1e-2)

    @onlyNativeDeviceTypes
    def test_linear_backward(self, device):
        torch.manual_seed(0)
        m = nn.Linear(4, 3).to(device); x = torch.randn(2, 4, device=device, requires_grad=True)
        m(x).pow(2).sum().backward()
        ref = nn.Linear(4, 3); ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
        xr = x.detach().cpu().requires_grad_(); ref(xr).pow(2).sum().backward()
        self.assertEqual(x.grad, xr.grad, exact_device=False)
        self.assertEqual(m.weight.grad.cpu(), ref.weight.grad)

    @onlyCUDA
    @largeTensorTest("1GB", "cuda")
    def test_large_alloc(self, device):
        x = torch.empty(2**28, device=device)
        self.assertEqual(x.numel(), 2**28)

    @onlyCUDA
    @skipCUDAIfNoCudnn
    def test_conv_cudnn(self, device):
        torch.manual_seed(0)
        c = nn.Conv2d(3, 4, 3).to(device); x = torch.randn(1, 3, 8, 8, device=device)
        ref = nn.Conv2d(3, 4, 3); ref.load_state_dict({k: v.cpu() for k, v in c.state_dict().items()})
        self.assertEqual(c(x).cpu(), ref(x.cpu()), atol=1e-5, rtol=1e-5)

instantiate_device_type_tests(TestDeviceGeneric, globals())

if __name__ == "__main__":
    run_tests()
