"""test_modules-style ModuleInfo checks over the modules the emulator's ModuleInfo sweep found wrong, and a sample of
others: inputs made on cuda with the module moved there give the ModuleInfo's reference (NLLLoss's reference builds
`input.new_tensor([gpu scalars])`); modules made with device='cuda' or moved with .to()/.cuda(1) before their first
forward (lazy convolutions keep uninitialized parameters there) hold every parameter and buffer on that GPU; and a
CPU module and its copy on the GPU agree on outputs and gradients, as test_cpu_gpu_parity checks (an RNN in eval mode
refuses its backward, as cuDNN's does)."""
import copy

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_modules import module_db, modules
from torch.testing._internal.common_utils import TestCase, freeze_rng_state, run_tests

FIXED = {"nn.LazyConv2d", "nn.LazyConvTranspose1d", "nn.NLLLoss"}
OTHERS = {"nn.Linear", "nn.BatchNorm2d", "nn.GRU", "nn.MultiheadAttention", "nn.Embedding"}
SELECTED = [m for m in module_db if m.name in FIXED | OTHERS]
INPUTS = 3


def _first(module_inputs):
    return [m for m in module_inputs if m.forward_input is not None][:INPUTS]


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device).requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _tensors(value):
    return [t for t in torch.utils._pytree.tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class TestModuleDb(TestCase):
    def _placed(self, module, device, dtype):
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            self.assertEqual(t.device, torch.device(device), msg=name)
            if t.is_floating_point():
                self.assertEqual(t.dtype, dtype, msg=name)

    @onlyCUDA
    @modules(SELECTED, allowed_dtypes=(torch.float32,))
    def test_forward_matches_the_reference(self, device, dtype, module_info, training):
        for module_input in _first(module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                                  requires_grad=False, training=training)):
            with freeze_rng_state():
                m = module_info.module_cls(*module_input.constructor_input.args,
                                           **module_input.constructor_input.kwargs)
                m.to(device).to(dtype)
                m.train(training)
                args, kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
                outputs = m(*args, **kwargs)
                self.assertTrue(all(t.device.type == "cuda" for t in _tensors(outputs)))
                self._placed(m, torch.device(device), dtype)
                if module_input.reference_fn is not None:
                    self.assertEqual(outputs, module_input.reference_fn(m, *args, **kwargs))

    @onlyCUDA
    @modules(SELECTED, allowed_dtypes=(torch.float64,))
    def test_factory_kwargs_and_moves_place_every_tensor(self, device, dtype, module_info, training):
        for module_input in _first(module_info.module_inputs_func(module_info, device=device, dtype=dtype,
                                                                  requires_grad=False, training=training)):
            args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
            try:
                made = module_info.module_cls(*args, **kwargs, device=device, dtype=dtype)
            except TypeError:  # a module without factory kwargs (a loss)
                made = module_info.module_cls(*args, **kwargs).to(device, dtype)
            moved = module_info.module_cls(*args, **kwargs).to(dtype).cuda(1)
            inputs_1 = _to((module_input.forward_input.args, module_input.forward_input.kwargs), "cuda:1")
            for m, on, (f_args, f_kwargs) in ((made, device, (module_input.forward_input.args,
                                                              module_input.forward_input.kwargs)),
                                              (moved, "cuda:1", inputs_1)):
                m.train(training)
                self._placed(m, on, dtype)
                with torch.cuda.device(on):
                    outputs = m(*f_args, **f_kwargs)
                self._placed(m, on, dtype)
                self.assertTrue(all(t.device == torch.device(on) for t in _tensors(outputs)))

    @onlyCUDA
    @modules(SELECTED, allowed_dtypes=(torch.float32,))
    def test_cpu_gpu_parity(self, device, dtype, module_info, training):
        for module_input in _first(module_info.module_inputs_func(module_info, device="cpu", dtype=dtype,
                                                                  requires_grad=True, training=training)):
            cpu_args, cpu_kwargs = module_input.forward_input.args, module_input.forward_input.kwargs
            gpu_args, gpu_kwargs = _to((cpu_args, cpu_kwargs), device)
            cpu_m = module_info.module_cls(*module_input.constructor_input.args,
                                           **module_input.constructor_input.kwargs).to(dtype)
            if module_info.is_lazy:  # initialized on the CPU first: a GPU draws other numbers
                with torch.no_grad():
                    cpu_m(*cpu_args, **cpu_kwargs)
            gpu_m = copy.deepcopy(cpu_m).to(device)
            cpu_m.train(training)
            gpu_m.train(training)
            with freeze_rng_state():
                cpu_out = cpu_m(*cpu_args, **cpu_kwargs)
            with freeze_rng_state():
                gpu_out = gpu_m(*gpu_args, **gpu_kwargs)
            self.assertEqual(cpu_out, gpu_out, exact_device=False)
            if not training and module_info.module_cls in (torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM):
                with self.assertRaisesRegex(RuntimeError, "cudnn RNN backward can only be called in training mode"):
                    _tensors(gpu_out)[0].sum().backward()  # cuDNN's, which a GPU runs these on
                continue
            for c, g in zip(_tensors(cpu_out), _tensors(gpu_out)):
                if c.requires_grad:
                    grad = torch.randn_like(c)
                    c.backward(grad, retain_graph=True)
                    g.backward(grad.to(device), retain_graph=True)
            self.assertEqual([t.grad for t in _tensors((cpu_args, cpu_kwargs))],
                             [t.grad for t in _tensors((gpu_args, gpu_kwargs))], exact_device=False)
            self.assertEqual([p.grad for p in cpu_m.parameters()], [p.grad for p in gpu_m.parameters()],
                             exact_device=False)


instantiate_device_type_tests(TestModuleDb, globals(), only_for=("cuda",))


if __name__ == "__main__":
    run_tests()
