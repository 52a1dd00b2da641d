"""test_ops-style OpInfo checks over the ops the emulator's OpInfo sweep found wrong, and a sample of others: on each
dtype OpInfo lists for CUDA every sample runs and gives the CPU's values, dtypes and a cuda device (conjugate views
inside pinv and pinverse, GPU scalars passed to kaiser's linspace); on the dtypes it does not list, as PyTorch's
test_dtypes reads them, some sample the CPU runs must raise, as it does on a GPU (integer pools and convolutions,
uint8 resizes, half angle/igamma/histc, bool scatter_reduce)."""
import torch
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA, ops
from torch.testing._internal.common_methods_invocations import op_db

FIXED = {"linalg.pinv", "pinverse", "signal.windows.kaiser", "angle", "igamma", "histc", "addbmm",
         "nn.functional.bilinear", "nn.functional.max_pool2d", "nn.functional.avg_pool2d", "nn.functional.conv2d",
         "nn.functional.interpolate", "scatter_reduce", "native_dropout_backward"}
OTHERS = {"matmul", "softmax", "index_select", "where", "nn.functional.gelu"}
VARIANTS = {"", "bilinear", "amax"}
SELECTED = [op for op in op_db if op.name in FIXED | OTHERS and op.variant_test_name in VARIANTS]
SAMPLES = 3
# histc's integer dtypes run on CUDA and have no CPU kernel to compare with (test_emulator_devices.py checks them).
COMPARED = [op for op in SELECTED if op.name != "histc"]


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


def _host_sample(sample):
    host = sample.transform(_to_cpu)
    host.kwargs = {k: _to_cpu(v) for k, v in host.kwargs.items()}
    return host


def _first(samples, n=SAMPLES):
    return [s for _, s in zip(range(n), samples)]


class TestOpInfoDtypes(TestCase):
    @onlyCUDA
    @ops(COMPARED, allowed_dtypes=(torch.float32, torch.complex64, torch.int64))
    def test_supported_dtypes_match_the_cpu(self, device, dtype, op):
        for sample in _first(op.sample_inputs(device, dtype)):
            host = _host_sample(sample)
            torch.manual_seed(0)
            got = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
            want = host.output_process_fn_grad(op(host.input, *host.args, **host.kwargs))
            for t in (got if isinstance(got, (tuple, list)) else [got]):
                if isinstance(t, torch.Tensor):
                    self.assertEqual(t.device.type, "cuda")
                    self.assertEqual(t.cpu().device.type, "cpu")
            self.assertEqual(got, want, exact_device=False)

    @onlyCUDA
    def test_dtypes_only_the_cpu_has_raise(self, device):
        """PyTorch's test_dtypes lists a dtype for CUDA only when every sample runs there: on one the CPU lists and
        CUDA does not, some sample the CPU runs must raise on the GPU."""
        checked = 0
        for op in (op for op in SELECTED if op.name in FIXED):
            for dtype in sorted(op.supported_dtypes("cpu") - op.supported_dtypes(device), key=str):
                with self.subTest(op=op.name, dtype=dtype):
                    ran, refused = 0, 0
                    for sample in _first(op.sample_inputs("cpu", dtype), 8):
                        try:
                            op(sample.input, *sample.args, **sample.kwargs)
                        except Exception:
                            continue
                        ran += 1
                        on_gpu = sample.transform(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t)
                        try:
                            op(on_gpu.input, *on_gpu.args, **on_gpu.kwargs)
                        except (RuntimeError, NotImplementedError):
                            refused += 1
                    self.assertTrue(ran == 0 or refused > 0, f"all {ran} samples ran; a GPU refuses some")
                    checked += ran > 0
        self.assertGreater(checked, 10)


instantiate_device_type_tests(TestOpInfoDtypes, globals(), only_for=("cuda",))


if __name__ == "__main__":
    run_tests()
