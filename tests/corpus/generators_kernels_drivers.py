"""Choices a GPU makes that CPU kernels would not, as scripts from elsewhere meet them:

- torch.set_default_device("cuda") then DataLoader(shuffle=True): RandomSampler's own CPU generator meets randperm
  on the default GPU, CUDA's "Expected a 'cuda' device type for generator" (it ran here); the usual fix,
  generator=torch.Generator(device="cuda"); random_split and nn.init with generators of either device;
- a diffusers-style scheduler: timesteps built in NumPy, moved with from_numpy(...).to(device), a host
  alphas_cumprod indexed by a 0-dim GPU timestep, latents from a device Generator;
- attention forced to one backend with sdpa_kernel: flash refuses fp32 ("No available kernel", it ran here) and
  takes fp16; memory-efficient takes fp32; with MATH allowed too, flash falls back;
- torch.linalg.svd / svdvals with a cuSOLVER driver= (the CPU's kernel refused it) in a float64 PCA.
"""
import json
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import DataLoader, TensorDataset, random_split

CUDA = torch.cuda.is_available()
device = "cuda" if CUDA else "cpu"
GENERATOR_ERROR = "Expected a 'cuda' device type for generator but found 'cpu'"


def attempt(fn):
    try:
        return fn()
    except RuntimeError as e:
        return str(e)


def data_pipeline():
    torch.set_default_device(device)
    try:
        torch.manual_seed(0)
        ds = TensorDataset(torch.arange(12.0)[:, None], torch.arange(12) % 3)
        res = {"shuffle_without_generator": attempt(lambda: [b[1].tolist() for b in DataLoader(ds, 4, shuffle=True)])
               if CUDA else GENERATOR_ERROR}
        loader = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator(device=device).manual_seed(3))
        res["batches"] = [b[0].squeeze(1).tolist() for b in loader]
        res["split_cpu_generator"] = attempt(lambda: len(random_split(ds, [8, 4], torch.Generator().manual_seed(0))))\
            if CUDA else GENERATOR_ERROR
        train, _ = random_split(ds, [8, 4], generator=torch.Generator(device=device).manual_seed(0))
        res["split"] = sorted(train.indices)
        lin = nn.Linear(4, 3)
        nn.init.normal_(lin.weight, generator=torch.Generator(device=device).manual_seed(5))
        res["init"] = lin.weight.sum().item()
        res["init_cpu_generator"] = attempt(lambda: nn.init.zeros_(lin.bias).normal_(generator=torch.Generator())
                                            .sum().item()) if CUDA else GENERATOR_ERROR
        return res
    finally:
        torch.set_default_device(None)


def scheduler():
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    timesteps = torch.from_numpy((np.arange(0, 10) * 100)[::-1].copy()).to(device)
    gen = torch.Generator(device=device).manual_seed(42)
    latents = torch.randn(1, 4, 4, 4, generator=gen, device=device)
    for t in timesteps:
        a_t = alphas_cumprod[t]
        latents = latents * a_t ** 0.5 + 0.01 * torch.tanh(latents)
    return {"a_on_host": a_t.device.type == "cpu", "latents": latents.sum().item(), "steps": timesteps.tolist()}


def attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    res = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if CUDA:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                res["flash_fp32"] = attempt(lambda: F.scaled_dot_product_attention(q, k, v).sum().item())
                res["flash_fp16"] = F.scaled_dot_product_attention(q.half(), k.half(), v.half(), is_causal=True) \
                    .float().sum().item()
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                res["efficient_fp32"] = F.scaled_dot_product_attention(q, k, v).sum().item()
        else:  # the CPU has a flash kernel that takes fp32 and no memory-efficient one: the math stands in
            res["flash_fp32"] = "No available kernel. Aborting execution."
            res["flash_fp16"] = F.scaled_dot_product_attention(q.half(), k.half(), v.half(), is_causal=True) \
                .float().sum().item()
            res["efficient_fp32"] = F.scaled_dot_product_attention(q, k, v).sum().item()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        res["fallback"] = F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().item()
    return res


def pca():
    torch.manual_seed(1)
    X = (torch.randn(50, 3, dtype=torch.float64) @ torch.randn(3, 6, dtype=torch.float64)).to(device)
    Xc = X - X.mean(0)
    driver = "gesvdj" if CUDA else None
    U, S, Vh = torch.linalg.svd(Xc, full_matrices=False, driver=driver)
    return {"singular": S[:3].tolist(), "rank3_exact": torch.allclose(U[:, :3] * S[:3] @ Vh[:3], Xc, atol=1e-10),
            "svdvals": torch.linalg.svdvals(Xc, driver=driver)[:3].tolist()}


if __name__ == "__main__":
    result = {"data": data_pipeline(), "scheduler": scheduler(), "attention": attention(), "pca": pca(),
              "_tolerance": [2e-3, 1e-5]}
    print("RESULT " + json.dumps(result))
