"""test_view_ops-, test_indexing- and test_autograd-style checks (TestViewOps, TestIndexing, TestAutogradDeviceType)
over what the emulator's view, indexing and autograd-device sweep fixed, and a sample of what passed: views of a GPU
tensor alias it (`_base`, storage pointer, writes through, version counter) with the CPU's sizes, strides, offsets
and contiguity, copies do not; quantized GPU tensors from `_empty_affine_quantized` ravel to a view; advanced
indexing with host or GPU index tensors gets, sets, accumulates and backpropagates as on the CPU, host values for
`index_put_` are refused; in-place ops on views of GPU tensors backpropagate as on the CPU; a 0-dim host parameter
gets its gradient on the host; `.grad` on another device is refused; `torch.as_tensor` and the sparse constructors
given GPU tensors keep autograd's graph."""
import torch
from torch.autograd import gradcheck
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import TestCase, run_tests

VIEWS = {
    "slice": lambda t: t[1:, ::2], "t": lambda t: t.t(), "diagonal": lambda t: t.diagonal(offset=1),
    "select": lambda t: t.select(1, 2), "narrow": lambda t: t.narrow(1, 1, 3), "view": lambda t: t.view(2, 2, 6),
    "unsqueeze": lambda t: t.unsqueeze(1), "expand": lambda t: t[:, :1].expand(4, 5),
    "unfold": lambda t: t.unfold(1, 2, 2), "movedim": lambda t: t.view(2, 2, 6).movedim(0, 2),
    "as_strided": lambda t: t.as_strided((3, 3), (5, 2), 1), "dtype": lambda t: t.view(torch.int32),
    "flatten": lambda t: t.unsqueeze(0).flatten(0, 1), "unflatten": lambda t: t.unflatten(1, (2, 3)),
    "real": lambda t: t.view(torch.complex64).real,
    "view_as_real": lambda t: torch.view_as_real(t.view(torch.complex64)),
    "chunk": lambda t: t.chunk(3, dim=1)[1], "unbind": lambda t: t.unbind(1)[4],
}
COPIES = {
    "reshape_of_t": lambda t: t.t().reshape(-1), "contiguous_of_t": lambda t: t.t().contiguous(),
    "list_index": lambda t: t[[0, 2]], "mask": lambda t: t[t > 0], "flatten_of_t": lambda t: t.t().flatten(),
}
INDEXERS = [([0, 2],), (slice(None), [3, 1, 3]), ([[0, 1], [3, 2]], [5, 0]), (Ellipsis, [1, 4]), ([1, 3], slice(1, 4))]


def _source(device):
    return torch.arange(24.0).view(4, 6).sub(11).to(device)


class TestViewsOnGPUs(TestCase):
    def _aliasing(self, base, view):
        return (view._is_view(), view._base is base,
                view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr())

    @onlyCUDA
    def test_views_alias_with_the_cpus_layout(self, device):
        for name, make in VIEWS.items():
            with self.subTest(view=name):
                host, gpu = _source("cpu"), _source(device)
                want, got = make(host), make(gpu)
                self.assertEqual(self._aliasing(gpu, got), self._aliasing(host, want))
                self.assertTrue(self._aliasing(gpu, got)[2])
                self.assertEqual((got.shape, got.stride(), got.storage_offset(), got.is_contiguous()),
                                 (want.shape, want.stride(), want.storage_offset(), want.is_contiguous()))
                version = gpu._version
                got.zero_()
                want.zero_()
                self.assertEqual(gpu._version, version + 1)
                self.assertEqual(gpu, host, exact_device=False)

    @onlyCUDA
    def test_copies_do_not_alias(self, device):
        for name, make in COPIES.items():
            with self.subTest(copy=name):
                gpu = _source(device)
                got = make(gpu)
                self.assertFalse(got._is_view())
                self.assertNotEqual(got.untyped_storage().data_ptr(), gpu.untyped_storage().data_ptr())
                got.fill_(100)
                self.assertEqual(gpu, _source("cpu"), exact_device=False)

    @onlyCUDA
    def test_quantized_tensor_ravels_to_a_view(self, device):
        kwargs = dict(scale=2, zero_point=3, dtype=torch.quint8)
        host, q = torch._empty_affine_quantized([5, 4], **kwargs), torch._empty_affine_quantized([5, 4], device=device,
                                                                                               **kwargs)
        self.assertTrue(q.is_cuda and q.is_quantized)
        for make in (lambda t: t.ravel(), lambda t: t.t().ravel(), lambda t: t[1:, ::2]):
            got, want = make(q), make(host)
            self.assertEqual(self._aliasing(q, got), self._aliasing(host, want))
            self.assertEqual((got.shape, got.stride(), got.is_contiguous()), (want.shape, want.stride(),
                                                                            want.is_contiguous()))


class TestIndexingOnGPUs(TestCase):
    @onlyCUDA
    def test_advanced_indexing_matches_the_cpu(self, device):
        for indexer in INDEXERS:
            for index_device in ("cpu", device):
                with self.subTest(indexer=indexer, index_device=index_device):
                    results = []
                    for where, index_on in (("cpu", "cpu"), (device, index_device)):
                        key = tuple(torch.tensor(i, device=index_on) if isinstance(i, list) else i for i in indexer)
                        x = _source(where).requires_grad_()
                        got = x[key]
                        (got ** 2).sum().backward()
                        written = x.detach().clone()
                        written[key] = -got.detach()
                        summed = torch.zeros(6, device=where).index_put_(
                            (torch.tensor([1, 3, 1, 5], device=index_on),), torch.arange(4.0, device=where),
                            accumulate=True)
                        results.append((got, x.grad, written, summed))
                    self.assertEqual(results[1], results[0], exact_device=False)

    @onlyCUDA
    def test_index_put_refuses_host_values(self, device):
        x, index, values = torch.zeros(5, device=device), torch.tensor([0, 1]), torch.tensor([1.0, 2.0])
        with self.assertRaisesRegex(RuntimeError, "expected device cuda:0 but got device cpu for value tensor"):
            torch.index_put_(x, (index,), values, accumulate=True)
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            torch.index_put_(x, (index,), values)
        x[index] = values.to(device)
        self.assertEqual(x, torch.tensor([1.0, 2.0, 0, 0, 0]), exact_device=False)


class TestAutogradOnGPUs(TestCase):
    @onlyCUDA
    def test_in_place_ops_on_views_backpropagate(self, device):
        def modify(root, b):
            x = root.clone()
            x.narrow(1, 2, 2).narrow(0, 1, 2).mul_(b)
            x.select(1, 0).add_(b.sum())
            return x

        torch.manual_seed(0)
        root, b = torch.randn(4, 4, dtype=torch.double), torch.randn(2, 2, dtype=torch.double)
        grads = []
        for where in ("cpu", device):
            r, w = (t.clone().to(where).requires_grad_() for t in (root, b))
            (modify(r, w) ** 2).sum().backward()
            grads.append((r.grad, w.grad))
        self.assertEqual(grads[1], grads[0], exact_device=False)
        self.assertTrue(gradcheck(modify, (root.to(device).requires_grad_(), b.to(device).requires_grad_())))

    @onlyCUDA
    def test_host_scalar_parameter_gets_its_gradient_on_the_host(self, device):
        a = torch.nn.Parameter(torch.tensor(0.5))
        x = torch.arange(6.0, device=device)
        (x * a).sum().backward()
        self.assertEqual(a.grad.device, torch.device("cpu"))
        self.assertEqual(a.grad, torch.tensor(15.0))

    @onlyCUDA
    def test_grad_on_another_device_is_refused(self, device):
        with self.assertRaisesRegex(RuntimeError, "with device type 'cuda' to a tensor with device type 'cpu'"):
            torch.zeros(2).grad = torch.ones(2, device=device)
        with self.assertRaisesRegex(RuntimeError, "located on device with index '1' to a tensor located on device"):
            torch.zeros(2, device=device).grad = torch.ones(2, device="cuda:1")

    @onlyCUDA
    def test_tensors_made_from_gpu_tensors_keep_autograd(self, device):
        x = torch.randn(2, 2, dtype=torch.double, device=device, requires_grad=True)
        self.assertIs(torch.as_tensor(x, device=device), x)
        sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), x, (3, 2, 2), device=device)
        (sparse.to_dense() * 3).sum().backward()
        self.assertEqual(x.grad, torch.full((2, 2), 3.0, dtype=torch.double), exact_device=False)


instantiate_device_type_tests(TestViewsOnGPUs, globals(), only_for=("cuda",))
instantiate_device_type_tests(TestIndexingOnGPUs, globals(), only_for=("cuda",))
instantiate_device_type_tests(TestAutogradOnGPUs, globals(), only_for=("cuda",))

if __name__ == "__main__":
    run_tests()
