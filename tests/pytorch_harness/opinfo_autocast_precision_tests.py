"""PyTorch's own test styles the other files here leave out: OpInfo-driven CUDA-vs-CPU comparisons (`@ops` over a
filtered op_db, sample inputs moved to the CPU), test_ops_gradients' gradcheck of OpInfo samples on CUDA in double
with its batched and forward-mode checks, test_autocast's
per-op cast policies from AutocastTestLists, device-type tests with @precisionOverride/@toleranceOverride,
make_tensor and assertEqual's dtype-aware tolerances, and the common_cuda platform flags of an A100."""
import unittest
import torch
import torch.nn.functional as F
from torch.testing import make_tensor
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_cuda import (TEST_CUDA, SM80OrLater, SM90OrLater, PLATFORM_SUPPORTS_FLASH_ATTENTION,
                                                 PLATFORM_SUPPORTS_MEM_EFF_ATTENTION, PLATFORM_SUPPORTS_BF16, TEST_CUDNN)
from torch.testing._internal.common_device_type import (instantiate_device_type_tests, onlyCUDA, ops, dtypes,
    dtypesIfCUDA, precisionOverride, toleranceOverride, tol, OpDTypes)
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.autocast_test_lists import AutocastTestLists

NAMES = {"matmul", "nn.functional.layer_norm", "nn.functional.conv2d", "nonzero", "nn.functional.cross_entropy"}
SELECTED = [op for op in op_db if op.name in NAMES]


def _to_cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


class TestOpsCompareCpu(TestCase):
    @onlyCUDA
    @ops(SELECTED, allowed_dtypes=(torch.float32,))
    def test_compare_cpu(self, device, dtype, op):
        n = 0
        for sample in op.sample_inputs(device, dtype):
            cpu_sample = sample.transform(_to_cpu)
            got = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
            want = cpu_sample.output_process_fn_grad(op(cpu_sample.input, *cpu_sample.args, **cpu_sample.kwargs))
            for t in (got if isinstance(got, (tuple, list)) else [got]):
                if isinstance(t, torch.Tensor):
                    self.assertEqual(t.device.type, "cuda")
            self.assertEqual(got, want, atol=1e-3, rtol=1e-3, exact_device=False)
            n += 1
        self.assertGreater(n, 0)

    @onlyCUDA
    @ops([op for op in SELECTED if op.supports_autograd], dtypes=OpDTypes.supported, allowed_dtypes=(torch.double,))
    def test_fn_gradcheck(self, device, dtype, op):
        """test_ops_gradients-style: gradcheck on each sample, with the OpInfo's batched and forward-AD checks."""
        for i, sample in enumerate(op.sample_inputs(device, dtype, requires_grad=True)):
            if i == 2:
                break
            leaves = [t for t in (sample.input, *sample.args) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not leaves:
                continue
            def fn(*xs, sample=sample):
                it = iter(xs)
                swap = lambda t: next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t
                out = op(swap(sample.input), *[swap(a) for a in sample.args], **sample.kwargs)
                return sample.output_process_fn_grad(out)
            self.assertTrue(torch.autograd.gradcheck(fn, tuple(leaves), check_batched_grad=op.check_batched_grad,
                                                     check_forward_ad=op.supports_forward_ad, fast_mode=True))


instantiate_device_type_tests(TestOpsCompareCpu, globals(), only_for=("cpu", "cuda"))


@unittest.skipIf(not TEST_CUDA, "no cuda")
class TestAutocastPolicies(TestCase):
    """test_autocast-style: each op under torch.autocast("cuda") returns the dtype CUDA's cast policy gives, and the
    values of running it on inputs cast by hand."""
    def setUp(self):
        super().setUp()
        self.lists = AutocastTestLists(torch.device("cuda:0"))

    def _cpu(self, v):
        if isinstance(v, torch.Tensor):
            return v.cpu()
        if isinstance(v, (tuple, list)):
            return type(v)(self._cpu(x) for x in v)
        return v

    def _cast(self, v, dtype):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        if isinstance(v, (tuple, list)):
            return type(v)(self._cast(x, dtype) for x in v)
        return v

    def _run(self, op, args, out_type, module=torch, method=False, fast_dtype=torch.float16, add_kwargs=None):
        add_kwargs = add_kwargs or {}
        fn = (lambda *a, **k: getattr(a[0], op)(*a[1:], **k)) if method else getattr(module, op)
        with torch.autocast("cuda", dtype=fast_dtype):
            out = fn(*args, **add_kwargs)
        first = out[0] if isinstance(out, tuple) else out
        self.assertEqual(first.dtype, out_type, msg=f"{op}: {first.dtype} under autocast, CUDA gives {out_type}")
        self.assertEqual(first.device.type, "cuda")
        control = fn(*self._cast(args, out_type), **add_kwargs)
        self.assertEqual(out, control, msg=f"{op} differs from running it on inputs cast by hand")
        if not op.startswith("cudnn_"):  # cuDNN's own ops have no CPU kernel
            cpu_control = fn(*self._cast(self._cpu(args), out_type), **add_kwargs)
            self.assertEqual(out, cpu_control, exact_device=False, atol=2e-3, rtol=2e-3)

    def test_torch_fp16(self):
        for op_with_args in self.lists.torch_fp16:
            op, args = op_with_args[0], op_with_args[1]
            if len(op_with_args) == 3 and op_with_args[2]:
                continue
            with self.subTest(op=op):
                self._run(op, args, torch.float16)

    def test_torch_fp32(self):
        for op_with_args in self.lists.torch_fp32:
            op, args, kwargs = op_with_args[0], op_with_args[1], (op_with_args[2] if len(op_with_args) > 2 else {})
            with self.subTest(op=op):
                self._run(op, args, torch.float32, add_kwargs=kwargs)

    def test_torch_need_autocast_promote(self):
        for op, args in self.lists.torch_need_autocast_promote:
            with self.subTest(op=op):
                self._run(op, args, torch.float32)

    def test_nn_fp16_and_fp32(self):
        for op, args in self.lists.nn_fp16:
            with self.subTest(op=op):
                self._run(op, args, torch.float16, module=torch._C._nn)
        for op_with_args in self.lists.nn_fp32:
            op, args, kwargs = op_with_args[0], op_with_args[1], (op_with_args[2] if len(op_with_args) > 2 else {})
            with self.subTest(op=op):
                self._run(op, args, torch.float32, module=torch._C._nn, add_kwargs=kwargs)

    def test_linalg_and_methods(self):
        for op, args in self.lists.linalg_fp16:
            with self.subTest(op=op):
                self._run(op, args, torch.float16, module=torch._C._linalg)
        for op, args in self.lists.methods_fp16:
            with self.subTest(op=op):
                self._run(op, args, torch.float16, method=True)
        for op, args in self.lists.methods_fp32:
            with self.subTest(op=op):
                self._run(op, args, torch.float32, method=True)

    def test_banned(self):
        with torch.autocast("cuda", dtype=torch.float16):
            for op, args, module in self.lists.banned:
                with self.subTest(op=op):
                    with self.assertRaisesRegex(RuntimeError, "unsafe to autocast"):
                        getattr(module, op)(*args)


class TestPrecisionDeviceType(TestCase):
    @dtypes(torch.float, torch.double)
    @dtypesIfCUDA(torch.float, torch.double, torch.half, torch.bfloat16)
    @precisionOverride({torch.half: 2e-2, torch.bfloat16: 8e-2})
    def test_mean_precision(self, device, dtype):
        x = make_tensor((64, 33), device=device, dtype=dtype, low=-2, high=2)
        self.assertEqual(x.device.type, torch.device(device).type)
        self.assertEqual(x.mean(1), x.double().mean(1).to(dtype))
        self.assertEqual(x.mean(1).cpu(), x.cpu().double().mean(1), exact_dtype=False)

    @onlyCUDA
    @dtypes(torch.half, torch.bfloat16)
    @toleranceOverride({torch.half: tol(atol=1e-2, rtol=1e-2), torch.bfloat16: tol(atol=5e-2, rtol=5e-2)})
    def test_mm_half_against_cpu_float(self, device, dtype):
        a = make_tensor((17, 31), device=device, dtype=dtype, low=-1, high=1)
        b = make_tensor((31, 9), device=device, dtype=dtype, low=-1, high=1)
        out = a @ b
        self.assertEqual(out.dtype, dtype)
        self.assertEqual(out, (a.cpu().float() @ b.cpu().float()).to(dtype), exact_device=False)

    @onlyCUDA
    def test_assert_equal_checks_device_and_dtype(self, device):
        x = make_tensor((3,), device=device, dtype=torch.float32)
        with self.assertRaises(AssertionError):
            self.assertEqual(x, x.cpu(), exact_device=True)
        with self.assertRaises(AssertionError):
            self.assertEqual(x, x.double())
        self.assertEqual(x, x.cpu(), exact_device=False)
        self.assertEqual(x, x.double(), exact_dtype=False)

    @onlyCUDA
    def test_make_tensor_options(self, device):
        t = make_tensor((4, 5), device=device, dtype=torch.int64, low=3, high=7, noncontiguous=True)
        self.assertFalse(t.is_contiguous())
        self.assertTrue(((t >= 3) & (t < 7)).all().item())
        m = make_tensor((6,), device=device, dtype=torch.bool)
        self.assertEqual(m.dtype, torch.bool)
        self.assertEqual(m.device, torch.device(device))
        e = make_tensor((0, 3), device=device, dtype=torch.float16)
        self.assertEqual(e.numel(), 0)


instantiate_device_type_tests(TestPrecisionDeviceType, globals(), only_for=("cpu", "cuda"))


@unittest.skipIf(not TEST_CUDA, "no cuda")
class TestPlatformFlags(TestCase):
    def test_flags_agree_with_the_device(self):
        major, minor = torch.cuda.get_device_capability()
        self.assertEqual(SM80OrLater, (major, minor) >= (8, 0))
        self.assertEqual(SM90OrLater, (major, minor) >= (9, 0))
        self.assertEqual(bool(PLATFORM_SUPPORTS_BF16), (major, minor) >= (8, 0))
        self.assertTrue(TEST_CUDNN)
        self.assertTrue(PLATFORM_SUPPORTS_MEM_EFF_ATTENTION)
        self.assertEqual(bool(PLATFORM_SUPPORTS_FLASH_ATTENTION), (major, minor) >= (8, 0))
        self.assertTrue(torch.cuda.is_bf16_supported())
        # a Linux CUDA wheel is built with FlashAttention (USE_FLASH_ATTENTION); SDPA uses it on sm80+
        self.assertTrue(torch.backends.cuda.is_flash_attention_available())

    @unittest.skipIf(not PLATFORM_SUPPORTS_FLASH_ATTENTION, "no flash")
    def test_flash_backend_fp16_matches_math(self):
        from torch.nn.attention import sdpa_kernel, SDPBackend
        q, k, v = (make_tensor((2, 4, 16, 32), device="cuda", dtype=torch.float16, low=-1, high=1) for _ in range(3))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), is_causal=True)
        self.assertEqual(out.float().cpu(), ref, atol=2e-3, rtol=2e-3)

    @unittest.skipIf(not PLATFORM_SUPPORTS_FLASH_ATTENTION, "no flash")
    def test_flash_backend_refuses_fp32(self):
        from torch.nn.attention import sdpa_kernel, SDPBackend
        q = torch.randn(2, 4, 16, 32, device="cuda")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            with self.assertRaisesRegex(RuntimeError, "No available kernel"):
                F.scaled_dot_product_attention(q, q, q)


if __name__ == "__main__":
    run_tests()
