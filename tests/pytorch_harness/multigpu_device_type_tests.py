"""test_cuda_multigpu- and test_data_parallel-style TestCases and device-type tests (instantiate_device_type_tests) on
emulated GPUs."""
import unittest, torch, torch.nn as nn
import torch.nn.parallel as dp
from collections import namedtuple
from torch.testing._internal.common_utils import TestCase, run_tests, NoTest, skipIfRocm
from torch.testing._internal.common_cuda import TEST_CUDA, TEST_MULTIGPU, TEST_CUDNN, SM80OrLater, PLATFORM_SUPPORTS_BF16, tf32_on_and_off
from torch.testing._internal.common_device_type import (instantiate_device_type_tests, onlyCUDA, deviceCountAtLeast,
    dtypes, largeTensorTest, dtypesIfCUDA, precisionOverride, skipCUDAIfNoCudnn, onlyNativeDeviceTypes)

class TestMultiGPU(TestCase):
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

class TestDataParallelStyle(TestCase):
    @unittest.skipIf(not TEST_MULTIGPU, "multi-GPU not supported")
    def test_data_parallel_module(self):
        l = nn.Linear(10, 5).float().cuda()
        i = torch.randn(20, 10, dtype=torch.float, device="cuda:1")
        l.cuda(1)
        expected_out = l(i)
        loss = expected_out.sum()
        loss.backward()
        expected_grads = [p.grad.clone() for p in l.parameters()]
        l.zero_grad()
        net = nn.DataParallel(l, device_ids=[1, 0])
        out = net(i)
        self.assertEqual(out.get_device(), 1)
        self.assertEqual(out, expected_out, atol=1e-5, rtol=0)
        out.sum().backward()
        for p, g in zip(l.parameters(), expected_grads):
            self.assertEqual(p.grad, g, atol=1e-5, rtol=0)

    @unittest.skipIf(not TEST_MULTIGPU, "multi-GPU not supported")
    def test_replicate_and_parallel_apply(self):
        module = nn.Linear(10, 5).float().cuda()
        input = torch.randn(2, 10, dtype=torch.float, device="cuda")
        expected_output = module(input)
        for devices in [(0, 1), [0, 1]]:
            replicas = dp.replicate(module, devices)
            for i, replica in enumerate(replicas):
                for p in replica.parameters():
                    self.assertEqual(p.get_device(), i)
                replica_input = input.cuda(i)
                self.assertEqual(replica(replica_input), expected_output)
        l1 = nn.Linear(10, 5).to("cuda:0", torch.float); l2 = nn.Linear(10, 5).to("cuda:1", torch.float)
        i1 = torch.randn(2, 10, device="cuda:0"); i2 = torch.randn(2, 10, device="cuda:1")
        expected1, expected2 = l1(i1), l2(i2)
        outputs = dp.parallel_apply((l1, l2), (i1, i2), None)
        self.assertEqual(outputs[0], expected1); self.assertEqual(outputs[1], expected2)

    @unittest.skipIf(not TEST_MULTIGPU, "multi-GPU not supported")
    def test_scatter_gather(self):
        input = torch.randn(4, 4, device="cuda:0", requires_grad=True)
        result = dp.scatter(input, (0, 1))
        self.assertEqual(len(result), 2)
        self.assertEqual(result[0], input[:2]); self.assertEqual(result[1].get_device(), 1)
        grad = torch.randn(2, 4, device="cuda:1")
        result[1].backward(grad)
        self.assertEqual(input.grad[2:], grad.cpu().cuda(0)); self.assertEqual(input.grad[:2].abs().sum().item(), 0)
        inputs = (torch.randn(2, 4, device="cuda:0"), torch.randn(2, 4, device="cuda:1"))
        out = dp.gather(inputs, 0)
        self.assertEqual(out[:2], inputs[0]); self.assertEqual(out[2:], inputs[1].cuda(0))
        out_cpu = dp.gather(inputs, -1)
        self.assertEqual(out_cpu.device.type, "cpu")

    @unittest.skipIf(not TEST_MULTIGPU, "multi-GPU not supported")
    def test_data_parallel_nested_output_and_buffers(self):
        Out = namedtuple("Out", ["a", "b"])
        class Net(nn.Module):
            def __init__(self):
                super().__init__(); self.fc = nn.Linear(4, 4); self.bn = nn.BatchNorm1d(4)
            def forward(self, x):
                y = self.bn(self.fc(x))
                return {"out": Out(y, [y * 2, (y.sum(),)])}
        net = Net().cuda()
        x = torch.randn(8, 4, device="cuda")
        out = nn.DataParallel(net, device_ids=[0, 1])(x)["out"]
        self.assertIsInstance(out, Out)
        self.assertEqual(out.b[0], out.a * 2)
        self.assertEqual(out.b[1][0].shape, torch.Size([2]))
        fn = dp.data_parallel(nn.Linear(4, 2).cuda(), x, device_ids=[0, 1])
        self.assertEqual(fn.shape, torch.Size([8, 2]))


instantiate_device_type_tests(TestDeviceGeneric, globals())

if __name__ == "__main__":
    run_tests()
