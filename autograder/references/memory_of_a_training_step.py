"""Reference answers for the memory-of-a-training-step notebook (chapter 7; hidden from learners, see autograder/README.md).

The chapter's model is an MLP: for each pair of consecutive widths a Linear(widths[i], widths[i+1]) and a ReLU,
trained on `model(x).square().mean()` with SGD, SGD with momentum or Adam (PyTorch's foreach path, as on a GPU).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # tensors of the parameters' size the optimizer keeps
# Adam's foreach step makes one more: exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs) (torch/optim/adam.py).
STEP_TEMPORARIES = {"sgd": 0, "momentum": 0, "adam": 1}


def training_step_memory(widths, batch: int, optimizer: str = "adam", dtype=torch.float32) -> dict:
    """Bytes on the GPU in a steady-state training step of the chapter's MLP, by kind and at two moments."""
    element = torch.empty((), dtype=dtype).element_size()
    parameters = sum(a * b + b for a, b in zip(widths, widths[1:])) * element
    gradients = parameters
    optimizer_state = OPTIMIZER_STATES[optimizer] * parameters
    activations = batch * sum(widths[1:]) * element  # each ReLU's output; each Linear saves its input, counted already
    inputs = batch * widths[0] * element
    return {
        "parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state,
        "activations": activations, "inputs": inputs,
        # gradients were set to None by zero_grad() at the end of the previous step
        "end_of_forward": parameters + optimizer_state + inputs + activations,
        # activations are gone after backward; the step adds its temporaries
        "optimizer_step": parameters + gradients + optimizer_state + inputs
                          + STEP_TEMPORARIES[optimizer] * parameters,
    }


def choose_checkpoints(width: int, hiddens, batch: int, cap_bytes: int, measure_step) -> list[int]:
    """The blocks to checkpoint so the measured peak fits `cap_bytes` with the least step time (every subset tried).

    `measure_step(width, hiddens, batch, checkpointed)` returns (peak_bytes, step_ms) from the emulator.
    """
    best = None
    for count in range(len(hiddens) + 1):
        for chosen in itertools.combinations(range(len(hiddens)), count):
            peak, step_ms = measure_step(width, hiddens, batch, list(chosen))
            if peak <= cap_bytes and (best is None or step_ms < best[0] - 1e-9):
                best = (step_ms, list(chosen))
    return None if best is None else best[1]


def accumulate_gradients(ddp_model, micro_batches) -> None:
    """Backward on every (inputs, targets) micro-batch, mean loss over them; only the last one all-reduces."""
    # The forward must run inside no_sync too: DDP's forward decides whether the coming backward all-reduces.
    for index, (inputs, targets) in enumerate(micro_batches):
        if index < len(micro_batches) - 1:
            with ddp_model.no_sync():
                (F.mse_loss(ddp_model(inputs), targets) / len(micro_batches)).backward()
        else:
            (F.mse_loss(ddp_model(inputs), targets) / len(micro_batches)).backward()
