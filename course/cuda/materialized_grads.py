"""The zeros autograd hands a custom `autograd.Function`'s backward for outputs no gradient reached live on their GPU.

With materialized gradients (the default, `ctx.set_materialize_grads(True)`), an output that got no gradient (unused,
or marked non-differentiable) reaches `backward` as zeros that C++ makes from the output's recorded C++ device: the
host, for an emulated tensor, where a GPU box gives zeros on the output's GPU. The forward's output devices are noted
on its node, and such a host gradient for a GPU output moves to that GPU before the program's backward sees it.
"""
from __future__ import annotations

import torch
from torch.autograd.function import BackwardCFunction, Function

from course.cuda.devices import CPU, EmulatedTensor
from course.cuda.transfers import device_of, move

_function_apply = Function.__dict__["apply"].__func__
_backward_apply = BackwardCFunction.apply


def function_apply(cls, *args, **kwargs):
    outputs = _function_apply(cls, *args, **kwargs)
    listed = outputs if isinstance(outputs, tuple) else (outputs,)
    node = next((t.grad_fn for t in listed if isinstance(t, torch.Tensor) and isinstance(t.grad_fn, BackwardCFunction)),
                None)
    if node is not None:
        places = [device_of(t) if isinstance(t, torch.Tensor) else CPU for t in listed]
        if any(place != CPU for place in places):
            node._emulated_output_devices = places
    return outputs


def backward_apply(self, *grads):
    places = getattr(self, "_emulated_output_devices", None)
    if places is not None and len(places) == len(grads):
        grads = tuple(move(grad, place) if place != CPU and isinstance(grad, torch.Tensor)
                      and not isinstance(grad, EmulatedTensor) and device_of(grad) == CPU else grad
                      for grad, place in zip(grads, places))
    return _backward_apply(self, *grads)


PATCHES = [(Function, {"apply": classmethod(function_apply)}), (BackwardCFunction, {"apply": backward_apply})]
