"""test_tensor_creation_ops-, test_nn- and test_torch-style device-type tests on emulated GPUs: factories with out=
and on several GPUs, torch.asarray's aliasing across devices, cross-device errors (cat, block_diag, mse_loss),
generators of the other device, legacy CUDA types and storages, copies that share memory, deterministic mode's
alerts and CUDA's deterministic ReflectionPad2d backward, and sync debug mode."""
import copy
from itertools import product

import numpy as np
import torch
import torch.nn.functional as F
from torch.testing import make_tensor
from torch.testing._internal.common_device_type import (deviceCountAtLeast, dtypes, instantiate_device_type_tests,
                                                        onlyCUDA)
from torch.testing._internal.common_utils import CudaSyncGuard, TestCase, run_tests


class TestCreationDeviceType(TestCase):
    exact_dtype = True

    @deviceCountAtLeast(2)
    def test_cat_different_devices(self, devices):
        cuda0 = torch.randn((3, 3), device=devices[0])
        cuda1 = torch.randn((3, 3), device=devices[1])
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            torch.cat((cuda0, cuda1))
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            torch.cat((cuda0, cuda0), out=cuda1)

    def test_block_diag_cross_device(self, device):
        with self.assertRaisesRegex(RuntimeError, "torch.block_diag: input tensors must all be on the same device."
                                                  " Input 0 is on device cpu and input 1 is on device "):
            torch.block_diag(torch.ones(2, 2).cpu(), torch.ones(2, 2, device=device))

    @deviceCountAtLeast(1)
    def test_tensor_device(self, devices):
        self.assertEqual('cuda:0', str(torch.tensor(5).cuda(0).device))
        self.assertEqual('cuda:0', str(torch.tensor(5, dtype=torch.int64, device=0).device))
        self.assertEqual('cuda:0', str(torch.tensor(np.random.randn(2, 3), device='cuda:0').device))
        for device in devices:
            with torch.cuda.device(device):
                device_string = 'cuda:' + str(torch.cuda.current_device())
                self.assertEqual(device_string, str(torch.tensor(5, dtype=torch.int64, device='cuda').device))
        with self.assertRaises(RuntimeError):
            torch.tensor(5).cuda('cpu')
        with self.assertRaises(RuntimeError):
            torch.tensor(5).cuda('cpu:0')
        if len(devices) > 1:
            self.assertEqual('cuda:1', str(torch.tensor(5).cuda('cuda:1').device))
            self.assertEqual('cuda:1', str(torch.tensor(torch.ones((2, 3)), device='cuda:1').device))

    def test_zeros_and_range_out(self, device):
        res1 = torch.zeros(100, 100, device=device)
        res2 = torch.tensor((), device=device)
        torch.zeros(100, 100, device=device, out=res2)
        self.assertEqual(res1, res2)
        res1 = torch.range(0, 1, device=device)
        torch.range(0, 1, device=device, out=res2)
        self.assertEqual(res1, res2, atol=0, rtol=0)
        x = torch.zeros(2, 3, device=device)
        torch.range(0, 3, device=device, out=x.narrow(1, 1, 2))
        self.assertEqual(x, torch.tensor(((0, 0, 1), (0, 2, 3)), device=device, dtype=torch.float32), atol=0, rtol=0)

    def test_randperm_device_compatibility(self, device):
        cpu_gen = torch.Generator(device='cpu')
        torch.randperm(0, device='cuda:0', generator=torch.Generator(device='cuda:1'))
        torch.randperm(0, device='cuda', generator=torch.Generator(device='cpu'))
        for n in (1, 3, 100):
            torch.randperm(n, device='cuda:0', generator=torch.Generator(device='cuda:1'))
            regex = 'Expected a .* device type for generator but found .*'
            cuda_t = torch.tensor(n, device='cuda')
            self.assertRaisesRegex(RuntimeError, regex, lambda: torch.randperm(n, device='cuda', generator=cpu_gen))
            self.assertRaisesRegex(RuntimeError, regex,
                                   lambda: torch.randperm(n, device='cuda', generator=cpu_gen, out=cuda_t))

    def test_tensor_factory_gpu_type(self, device):
        saved_type = torch.tensor([]).type()
        torch.set_default_tensor_type(torch.cuda.FloatTensor)
        x = torch.zeros((5, 5))
        self.assertIs(torch.float32, x.dtype)
        self.assertTrue(x.is_cuda)
        torch.set_default_tensor_type(torch.cuda.DoubleTensor)
        x = torch.zeros((5, 5))
        self.assertIs(torch.float64, x.dtype)
        self.assertTrue(x.is_cuda)
        torch.set_default_tensor_type(saved_type)

    @deviceCountAtLeast(2)
    def test_zeros_like_multiple_device(self, devices):
        expected = torch.zeros(100, 100, device=devices[0])
        x = torch.randn(100, 100, device=devices[1], dtype=torch.float32)
        output = torch.zeros_like(x)
        self.assertEqual(output, expected)

    @deviceCountAtLeast(2)
    @dtypes(torch.float32, torch.int64)
    def test_asarray_mult_devices(self, devices, dtype):
        original = make_tensor((5, 5), dtype=dtype, device=devices[0])
        result = torch.asarray(original, device=devices[1])
        self.assertNotEqual(result.data_ptr(), original.data_ptr())
        self.assertEqual(original, result, exact_device=False)
        self.assertEqual(result.device, torch.device(devices[1]))
        with self.assertRaisesRegex(ValueError, f"from device '{devices[0]}' to '{devices[1]}'"):
            torch.asarray(original, device=devices[1], copy=False)
        self.assertIs(torch.asarray(original, device=devices[0]), original)


class TestNNTorchDeviceType(TestCase):
    def test_ReflectionPad2d_large_deterministic(self, device):
        original_deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            torch.use_deterministic_algorithms(True)
            x = torch.randn([2, 6000, 6, 6], device=device, requires_grad=True)
            ref_x = x.detach().cpu().requires_grad_()
            out = F.pad(x, (1, 2, 3, 4), mode='reflect')
            ref_out = F.pad(ref_x, (1, 2, 3, 4), mode='reflect')
            self.assertEqual(out, ref_out)
            g = torch.randn_like(out)
            out.backward(g)
            ref_out.backward(g.cpu())
            self.assertEqual(x.grad, ref_x.grad)
        finally:
            torch.use_deterministic_algorithms(original_deterministic)

    def test_nondeterministic_alerts(self, device):
        res = torch.nn.AdaptiveAvgPool2d(3)(torch.randn(2, 3, 3, requires_grad=True, device=device))
        self.check_nondeterministic_alert(lambda: res.backward(torch.ones_like(res), retain_graph=True),
                                          'adaptive_avg_pool2d_backward_cuda')
        res = torch.nn.FractionalMaxPool3d(2, output_ratio=0.5)(torch.randn(2, 3, 3, 3, 3, requires_grad=True,
                                                                            device=device))
        self.check_nondeterministic_alert(lambda: res.backward(torch.ones_like(res), retain_graph=True),
                                          'fractional_max_pool3d_backward_cuda')
        self.check_nondeterministic_alert(lambda: torch.histc(torch.tensor([], device=device), min=0, max=3),
                                          '_histc_cuda')

    def test_mse_loss_error(self, device):
        i = torch.randn((10, 1), device=device)
        t = torch.randn((10,))
        with self.assertRaisesRegex(RuntimeError, 'Expected all tensors to be on the same device'):
            F.mse_loss(i, t)

    def test_deepcopy(self, device):
        a = torch.randn(5, 5, device=device)
        b = torch.randn(5, 5, device=device)
        c = a.view(25)
        q = [a, [a.storage(), b.storage()], b, c]
        w = copy.deepcopy(q)
        self.assertEqual(w[0], q[0], atol=0, rtol=0)
        self.assertEqual(w[1], q[1], atol=0, rtol=0)
        w[0].add_(1)
        for i in range(a.numel()):
            self.assertEqual(w[1][0][i], q[1][0][i] + 1)
        self.assertEqual(w[3], c + 1)
        a.foo = 3
        self.assertEqual(copy.deepcopy(a).foo, 3)

    def test_copy_all_dtypes_and_devices(self, device):
        for dt in (torch.float32, torch.int64, torch.bool):
            x = torch.tensor([1, 2, 3, 4], dtype=dt, device=device)
            y = copy.copy(x)
            y.fill_(1)
            self.assertEqual(x, y)

    def test_storage_setitem(self, device):
        s = torch.cuda.FloatStorage(10)
        s[:] = 0
        l = [0] * 10
        self.assertEqual(s, torch.cuda.FloatStorage(l))
        l[2:7] = [1] * 5
        s[2:7] = 1
        self.assertEqual(s, torch.cuda.FloatStorage(l))

    def test_dtypetensor_warnings(self, device):
        with self.assertWarnsOnceRegex(UserWarning, 'The torch.cuda.*DtypeTensor constructors are no longer'):
            torch.cuda.FloatTensor([0])

    def test_sync_warning(self, device):
        def _ind_put_fn(x, ind, val):
            x[ind] = val
            return x

        x = torch.rand(4, device=device)
        y = torch.rand((), device=device)
        ind = torch.randint(4, (3,), device=device)
        ind_cpu = ind.cpu()
        repeats = torch.full((1,), 2, device=device)
        mask = torch.randint(2, (4,), device=device, dtype=bool)
        expect_no_sync = (lambda: _ind_put_fn(x, mask, 1.), lambda: _ind_put_fn(x, ind, y), lambda: x[ind],
                          lambda: torch.repeat_interleave(x, repeats, output_size=8))
        expect_sync = (lambda: _ind_put_fn(x, mask, y), lambda: _ind_put_fn(x, ind_cpu, y), lambda: x[mask],
                       lambda: x[ind_cpu], lambda: torch.repeat_interleave(x, repeats))
        for f, level in product(expect_no_sync, (1, 2)):
            with CudaSyncGuard(level):
                f()
        for f in expect_sync:
            with CudaSyncGuard(2):
                with self.assertRaisesRegex(RuntimeError, "called a synchronizing "):
                    f()


instantiate_device_type_tests(TestCreationDeviceType, globals(), only_for=("cuda",))
instantiate_device_type_tests(TestNNTorchDeviceType, globals(), only_for=("cuda",))

if __name__ == "__main__":
    run_tests()
