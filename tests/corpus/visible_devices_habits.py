"""Habits of 2024-26 scripts around which GPUs they see and where their tensors live, on two visible GPUs:

- CUDA_VISIBLE_DEVICES set in os.environ before `import torch`: the script sees two of the box's four GPUs,
  numbered from 0, and a third index is an invalid device ordinal (the emulator showed all four);
- torch.set_default_device("cuda") and get_default_device, a model built under `with torch.device("cuda:1")`,
  torch.cuda.device contexts nested, mem_get_info around an allocation;
- a host lookup table indexed by GPU timesteps (a diffusion scheduler's alphas_cumprod[t]): PyTorch refuses it on
  a GPU box (it ran here and gave a GPU tensor), and the fixed form;
- deterministic mode: EmbeddingBag's max-mode backward has no deterministic CUDA kernel (it ran here);
- pickle / deepcopy / torch.save to a BytesIO keep each tensor's GPU, and x.numpy() needs .cpu() first;
- host buffers shaped like GPU tensors (torch.zeros_like(x, device="cpu"), x.new_zeros(..., device="cpu"),
  torch.as_tensor(x, device="cpu")) and
  masks moved with .type_as(x) (they came out on the wrong side), and torch.histogram, which has no CUDA kernel;
- tooling that wraps GPU tensors: FlopCounterMode over a forward and backward, a TorchDispatchMode logging ops and
  devices, and a wrapper subclass (the scaled-int8 pattern of low-precision libraries) holding a GPU tensor.
"""
import os

os.environ["CUDA_VISIBLE_DEVICES"] = "1,3"

import copy  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

CUDA = torch.cuda.is_available()
device = torch.device("cuda" if CUDA else "cpu")
second = torch.device("cuda:1" if CUDA else "cpu")


def visibility(res):
    res["device_count"] = torch.cuda.device_count() if CUDA else 2
    if CUDA:
        try:
            torch.ones(1, device="cuda:2")
            res["third_index"] = "allocated"
        except RuntimeError as e:
            res["third_index"] = "invalid device ordinal" in str(e)
    else:
        res["third_index"] = True


def default_devices(res):
    torch.manual_seed(0)
    if CUDA:
        torch.set_default_device("cuda")
    res["default_is_cuda0"] = str(torch.get_default_device()) == ("cuda:0" if CUDA else "cpu")
    a = torch.randn(8, 8)
    res["factory_on_default"] = a.device == torch.get_default_device()
    torch.set_default_device(None)
    with torch.device(second):
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    res["ctx_model_on_second"] = all(p.device == second for p in model.parameters())
    res["model_out"] = model(a.to(second)).sum().item()
    if CUDA:
        trail = []
        with torch.cuda.device(1):
            trail.append(torch.cuda.current_device())
            with torch.cuda.device(0):
                trail.append(torch.zeros(1, device="cuda").device.index)
            trail.append(torch.cuda.current_device())
        res["nested"] = trail + [torch.cuda.current_device()]
        free0, _ = torch.cuda.mem_get_info(1)
        big = torch.empty(16, 1024, 1024, device="cuda:1")
        res["mem_get_info_drop_mb"] = round((free0 - torch.cuda.mem_get_info(1)[0]) / 2**20)
        del big
    else:
        res["nested"] = [1, 0, 1, 0]
        res["mem_get_info_drop_mb"] = 64


def scheduler_lookup(res):
    alphas_cumprod = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 50), 0)
    t = torch.tensor([3, 17, 42], device=device)
    try:
        alphas_cumprod[t]
        res["host_table_gpu_index"] = "ran" if CUDA else "refused"
    except RuntimeError as e:
        res["host_table_gpu_index"] = "refused" if "same device as the indexed tensor" in str(e) else str(e)
    res["fixed_lookup"] = alphas_cumprod.to(device)[t].sum().item()


def deterministic_bag(res):
    torch.manual_seed(1)
    bag = nn.EmbeddingBag(20, 4, mode="max").to(device)
    ids, offsets = torch.tensor([1, 5, 5, 7, 2], device=device), torch.tensor([0, 2], device=device)
    torch.use_deterministic_algorithms(True)
    try:
        bag(ids, offsets).sum().backward()
        res["max_bag_backward_deterministic"] = "ran" if CUDA else "raised"
    except RuntimeError as e:
        res["max_bag_backward_deterministic"] = "raised" if "embedding_bag_backward_cuda_max" in str(e) else str(e)
    finally:
        torch.use_deterministic_algorithms(False)
    bag.zero_grad()
    bag(ids, offsets).sum().backward()
    res["bag_grad_sum"] = bag.weight.grad.sum().item()


def python_protocols(res):
    torch.manual_seed(2)
    x = torch.randn(3, 4, device=second)
    back = pickle.loads(pickle.dumps(x))
    twin = copy.deepcopy(nn.Linear(4, 2).to(second))
    buf = io.BytesIO()
    torch.save({"x": x, "w": twin.weight}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    res["kept_devices"] = [back.device == second, twin.weight.device == second,
                           loaded["x"].device == second, torch.equal(back, x)]
    if CUDA:
        try:
            x.numpy()
            res["numpy"] = "converted a GPU tensor"
        except TypeError as e:
            res["numpy"] = str(e)
    else:
        res["numpy"] = ("can't convert cuda:1 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")


def host_side_buffers(res):
    torch.manual_seed(4)
    x = torch.randn(4, 3, device=second)
    staging = torch.zeros_like(x, device="cpu")
    staging.copy_(x)
    res["staging"] = [staging.device.type, float(staging.numpy().sum()), x.new_zeros(2, device="cpu").device.type,
                      torch.as_tensor(x, device="cpu").device.type]
    mask = (torch.arange(3) % 2).type_as(x)
    res["type_as_mask"] = [mask.device == second, str(mask.dtype), (x * mask).sum().item()]
    if CUDA:
        try:
            torch.histogram(x, bins=3)
            res["histogram_on_gpu"] = "ran"
        except NotImplementedError as e:
            res["histogram_on_gpu"] = "no CUDA kernel" if "'CUDA' backend" in str(e) else str(e)
    else:
        res["histogram_on_gpu"] = "no CUDA kernel"
    res["histogram_on_host"] = torch.histogram(x.cpu(), bins=3).hist.tolist()


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func.overloadpacket.__name__, getattr(out, "device", device).type))
        return out


class Scaled(torch.Tensor):
    """int8 data and a scale; every op sees the dequantised float32 value."""

    @staticmethod
    def __new__(cls, data, scale):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data, scale):
        self.data_, self.scale = data, scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.data_.float() * t.scale if isinstance(t, Scaled) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def dispatch_tools(res):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(device)
    x = torch.randn(16, 32, device=device)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).sum().backward()
    res["flops"] = {str(k): v for k, v in sorted(counter.get_flop_counts()["Global"].items(), key=str)}
    log = OpLog()
    with log:
        model(x).softmax(-1)
    res["logged"] = [[name, kind == device.type] for name, kind in log.ops]
    q = torch.randint(-8, 8, (8, 32), dtype=torch.int8, device=device)
    out = torch.mm(Scaled(q, 0.25), x.t())
    res["scaled_mm"] = [out.device.type == device.type, torch.equal(out, (q.float() * 0.25) @ x.t()),
                        out.sum().item()]


def main():
    res = {}
    for check in (visibility, default_devices, scheduler_lookup, deterministic_bag, python_protocols,
                  host_side_buffers, dispatch_tools):
        check(res)
    res["_tolerance"] = [1e-4, 1e-5]
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
