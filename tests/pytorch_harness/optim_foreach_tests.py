"""test_optim.py- and test_foreach.py-style checks over what the emulator's optimizer and foreach sweep fixed, and a
sample of optim_db: foreach ops over tensor lists that span two GPUs and the host (CUDA's slow path runs them index
by index), addcdiv's packed scalars (a host tensor is read, a GPU one refused), _foreach_copy_ across devices, a host
scalar tensor refused by _foreach_add's fused kernel and a 1-D one by every foreach op; every
CUDA input of Adam and SGD (foreach, fused, capturable, tensor lr) with params on two GPUs against the CPU's for-loop,
state on the param's GPU ('step' too when capturable or fused), and the state moved to another GPU by load_state_dict;
GradScaler with a fused optimizer skipping the step an inf gradient lands in."""
import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA, ops
from torch.testing._internal.common_methods_invocations import foreach_binary_op_db, foreach_reduce_op_db
from torch.testing._internal.common_optimizers import _get_optim_inputs_including_global_cliquey_kwargs, optim_db, optims
from torch.testing._internal.common_utils import TestCase, run_tests

BINARY = [op for op in foreach_binary_op_db if op.name in ("_foreach_add", "_foreach_mul", "_foreach_clamp_min")]
REDUCE = [op for op in foreach_reduce_op_db if op.name == "_foreach_norm"]
OPTIMS = [info for info in optim_db if info.name in ("Adam", "SGD")]


def _params(devices):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(device).requires_grad_()
            for shape, device in zip([(4, 3), (5,), (2, 2)], devices)]


def _steps(optimizer, params, steps=3):
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = (0.3 * p.detach().cpu() + torch.randn(p.shape, generator=gen)).to(p.device)
        optimizer.step()


class TestForeachAcrossDevices(TestCase):
    @onlyCUDA
    @ops(BINARY, dtypes=(torch.float32,))
    def test_binary_op_tensors_on_different_devices(self, device, dtype, op):
        host = list(op.sample_inputs("cpu", dtype, num_input_tensors=[3], same_size=True))[0].input
        other = [t * 2 + 1 for t in host]
        placed = [t.clone().to(d) for t, d in zip(host, ("cuda:0", "cuda:1", "cpu"))]
        placed_other = [t.to(d) for t, d in zip(other, ("cuda:0", "cuda:1", "cpu"))]
        expected = [op.ref(a, b) for a, b in zip(host, other)]
        actual = op.method_variant(placed, placed_other)
        self.assertEqual([t.device for t in actual], [t.device for t in placed])
        self.assertEqual([t.cpu() for t in actual], expected)
        op.inplace_variant(placed, placed_other)
        self.assertEqual([t.cpu() for t in placed], expected)
        with self.assertRaisesRegex(RuntimeError, "Expected all tensors to be on the same device"):
            op.method_variant(placed[:2], placed_other[:2][::-1])

    @onlyCUDA
    @ops(REDUCE, dtypes=(torch.float32,))
    def test_norm_over_two_gpus(self, device, dtype, op):
        host = list(op.sample_inputs("cpu", dtype, num_input_tensors=[4]))[0].input
        actual = op.method_variant([t.to(f"cuda:{i % 2}") for i, t in enumerate(host)])
        self.assertEqual([t.device.index for t in actual], [0, 1, 0, 1])
        self.assertEqual([t.cpu() for t in actual], [torch.linalg.vector_norm(t) for t in host])

    @onlyCUDA
    def test_packed_scalars_and_copy_across_devices(self, device):
        tensors = [torch.ones(3, device=device), torch.ones(2, device=device)]
        factors = [torch.full((3,), 4.0, device=device), torch.full((2,), 2.0, device=device)]
        torch._foreach_addcmul_(tensors, factors, factors, torch.tensor([0.5, 2.0]))
        self.assertEqual([t.cpu() for t in tensors], [torch.full((3,), 9.0), torch.full((2,), 9.0)])
        with self.assertRaisesRegex(RuntimeError, "Expected scalars to be on CPU, got cuda:0 instead."):
            torch._foreach_addcdiv_(tensors, factors, factors, torch.tensor([0.5, 2.0], device=device))
        destinations = [torch.zeros(3, device="cuda:1"), torch.zeros(2, device=device)]
        torch._foreach_copy_(destinations, [tensors[0], torch.ones(2)])
        self.assertEqual([d.device.index for d in destinations], [1, 0])
        self.assertEqual([d.cpu() for d in destinations], [torch.full((3,), 9.0), torch.ones(2)])

    @onlyCUDA
    def test_host_scalar_tensor_for_add_and_a_1d_scalar(self, device):
        tensors = [torch.full((2, 2), 2.0, device=device) for _ in range(2)]
        with self.assertRaisesRegex(RuntimeError, "scalar tensor expected to be on cuda:0 but is on cpu"):
            torch._foreach_add(tensors, torch.tensor(1.0), alpha=3.0)
        quarters = torch._foreach_div(tensors, torch.tensor(4.0))  # div and mul read a host scalar first
        self.assertEqual([t.cpu() for t in quarters], [torch.full((2, 2), 0.5)] * 2)
        with self.assertRaisesRegex(RuntimeError, "scalar tensor expected to be 0 dim but"):
            torch._foreach_add([torch.ones(2), tensors[0]], torch.ones(3, device=device))


class TestOptimOnTwoGPUs(TestCase):
    @onlyCUDA
    @optims(OPTIMS, dtypes=[torch.float32])
    def test_cuda_inputs_match_the_cpu_forloop_and_move_between_gpus(self, device, dtype, optim_info):
        for optim_input in _get_optim_inputs_including_global_cliquey_kwargs(device, dtype, optim_info,
                                                                             skip=("differentiable",)):
            kwargs = optim_input.kwargs
            on_gpu = bool(kwargs.get("capturable") or kwargs.get("fused"))
            host_kwargs = {k: v for k, v in kwargs.items() if k not in ("capturable", "fused", "foreach")}
            gpu_params, cpu_params = _params(["cuda:0", "cuda:1", "cuda:0"]), _params(["cpu"] * 3)
            gpu_opt = optim_info.optim_cls(gpu_params, **kwargs)
            cpu_opt = optim_info.optim_cls(cpu_params, **host_kwargs)
            _steps(gpu_opt, gpu_params)
            _steps(cpu_opt, cpu_params)
            self.assertEqual([p.cpu() for p in gpu_params], cpu_params, msg=optim_input.desc)
            for p, q in zip(gpu_params, cpu_params):
                for key, value in gpu_opt.state[p].items():
                    if torch.is_tensor(value):
                        want = p.device if key != "step" or on_gpu else torch.device("cpu")
                        self.assertEqual(value.device, want, msg=f"{optim_input.desc}: {key}")
                    self.assertEqual(value, cpu_opt.state[q][key], exact_device=False, msg=optim_input.desc)
            moved = [p.detach().to("cuda:1").requires_grad_() for p in gpu_params]
            moved_opt = optim_info.optim_cls(moved, **kwargs)
            moved_opt.load_state_dict(gpu_opt.state_dict())
            for p in moved:
                for key, value in moved_opt.state[p].items():
                    if torch.is_tensor(value) and (key != "step" or on_gpu):
                        self.assertEqual(value.device, torch.device("cuda:1"), msg=f"{optim_input.desc}: {key}")
            _steps(moved_opt, moved, 1)
            _steps(cpu_opt, cpu_params, 1)
            self.assertEqual([p.cpu() for p in moved], cpu_params, msg=optim_input.desc)

    @onlyCUDA
    def test_grad_scaler_skips_the_inf_step_of_a_fused_adam(self, device):
        results = []
        for where, fused in ((device, True), ("cpu", False)):
            params = _params([where] * 3)
            optimizer = torch.optim.Adam(params, lr=0.1, fused=fused)
            scaler = torch.amp.GradScaler(torch.device(where).type, init_scale=256.0)
            for step in range(3):
                optimizer.zero_grad()
                scaler.scale(sum((p * p).sum() for p in params)).backward()
                if step == 1:
                    with torch.no_grad():
                        params[0].grad[0, 0] = float("inf")
                scaler.step(optimizer)
                scaler.update()
            results.append(([p.detach().cpu() for p in params], scaler.get_scale(),
                            float(optimizer.state[params[0]]["step"])))
        self.assertEqual(results[0], results[1])
        self.assertEqual(results[0][1:], (256.0 * 0.5, 2.0))


instantiate_device_type_tests(TestForeachAcrossDevices, globals())
instantiate_device_type_tests(TestOptimOnTwoGPUs, globals())

if __name__ == "__main__":
    run_tests()
