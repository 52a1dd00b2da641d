"""What hidden tests call to be judged outside the learner's kernel: `check(got, reference, rtol=, atol=)`.

Anything decided inside the learner's kernel can be subverted by the learner's code (it runs first, in the
same interpreter), so hidden tests do not compare there. They only *record* the learner's results, and the
grading pipeline compares them, after the kernel is gone and outside the sandbox, with the results of the
same hidden tests run once on the solution notebook (the trusted run). The reference implementations and
the expected values therefore never enter the sandbox.

One module, three modes (chosen by the environment, or by the sandbox's guard):
- "learner" (the sandboxed kernel): `check` prints the learner's value on a marker line; `reference`
  thunks are never called and `references(...)` gives a stand-in that refuses to run;
- "trusted" (the pipeline's run of a solution notebook, `GRADER_MARKER` set): `check` evaluates the
  reference, asserts the solution matches it, and prints the expected value and tolerances;
- "trusted" without a marker (nbval, `make validate`): the same assertion, nothing printed.

A hidden test reads:
    from grading import check, references
    ref = references("when_to_use_gpus")
    for p, n in cases:                       # inputs from seeded generators, never from learner code
        check(amdahl_speedup(p, n), lambda: ref.amdahl_speedup(p, n), rtol=1e-9)
Without a reference, the solution's own result is the expected one. Tolerances always come from the trusted
run; record CPU tensors (`.cpu()`): reading an emulated GPU tensor would move the simulated clock.
"""
import importlib
import json
import math
import os

MODE = os.environ.get("GRADER_MODE", "trusted")
MARKER = os.environ.get("GRADER_MARKER")
_OWN = object()  # "no reference given": the solution's own result is the expected one


def configure(mode: str, marker: str | None) -> None:
    """Set by the sandbox's guard: learner mode, with the per-kernel nonce as marker."""
    global MODE, MARKER
    MODE, MARKER = mode, marker


class _Unavailable:
    """What `references(...)` gives in the learner's kernel: any use says the references are not here."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"references.{self._name}.{attr} exists only in the trusted run: wrap it in a "
                               "lambda passed to check() as the reference")
        return refuse


def references(chapter: str):
    """The hidden reference module `references.<chapter>` (trusted run), or a stand-in (learner's kernel)."""
    if MODE == "learner":
        return _Unavailable(chapter)
    return importlib.import_module(f"references.{chapter}")


def encode(value):
    """JSON for the values a test records: numbers (numpy scalars too), strings, None, lists/tuples, dicts,
    CPU tensors. Lists and tuples record alike."""
    import torch
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind in (list, tuple):
        return [encode(v) for v in value]
    if kind is dict:
        return {"dict": sorted(([encode(k), encode(v)] for k, v in value.items()), key=json.dumps)}
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        raise TypeError(f"check() records CPU tensors, this one is on {value.device}: call .cpu() on it first")
    if kind is torch.Tensor:
        flat = value.detach().reshape(-1)
        values = flat.double().tolist() if flat.is_floating_point() else flat.tolist()
        return {"tensor": str(value.dtype), "shape": list(value.shape),
                "values": [v if not isinstance(v, float) or math.isfinite(v) else repr(v) for v in values]}
    if kind in (torch.device, torch.dtype):
        return {"str": str(value)}
    if kind.__module__ == "numpy" and getattr(value, "shape", None) == ():
        return encode(value.item())  # numpy scalars (np.float64, np.int64, np.bool_) as Python numbers
    raise TypeError(f"check() cannot record a {kind.__module__}.{kind.__qualname__}: record numbers, strings, "
                    "lists, dicts or CPU tensors")


def _number(x):
    """Non-finite floats travel as their repr ('nan', 'inf'); anything else that is not a number stays None."""
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return x


def _close(got, want, rtol, atol) -> bool:
    if isinstance(want, bool) or isinstance(got, bool) or not isinstance(want, (int, float)) \
            or not isinstance(got, (int, float)):
        return type(got) is type(want) and got == want
    if isinstance(want, int) and isinstance(got, int) and not (rtol or atol):
        return got == want
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return got == want or abs(got - want) <= atol + rtol * abs(want)


def matches(got, want, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Encoded `got` equals encoded `want`, numbers within atol + rtol * |want| (torch.allclose's rule)."""
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            matches(g, w, rtol, atol) for g, w in zip(got, want))
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return False
        if "tensor" in want:
            return got["tensor"] == want["tensor"] and got["shape"] == want["shape"] and len(got["values"]) == len(
                want["values"]) and all(_close(_number(g), _number(w), rtol, atol) for g, w in zip(got["values"], want["values"]))
        if "float" in want:
            return _close(_number(got["float"]), _number(want["float"]), rtol, atol)
        return matches(list(got.values()), list(want.values()), rtol, atol)
    if isinstance(got, (list, dict)):
        return False
    return _close(got, want, rtol, atol)


def check(got, reference=_OWN, *, rtol: float = 0.0, atol: float = 0.0, what: str = "") -> None:
    """Record one result of the code under test; `reference` is the expected value or a thunk giving it.

    `what` names the check in messages (the learner's feedback shows it, never the expected value)."""
    mine = encode(got)
    if MODE == "learner":
        if MARKER:
            print(f"\n{MARKER} check {json.dumps({'got': mine})}", flush=True)
        return
    want = mine if reference is _OWN else encode(reference() if callable(reference) else reference)
    if not matches(mine, want, rtol, atol):
        raise AssertionError(f"{what or 'check'}: the solution gives {got!r}, the reference {want!r} "
                             f"(rtol={rtol}, atol={atol})")
    if MARKER:
        print(f"\n{MARKER} check {json.dumps({'want': want, 'rtol': rtol, 'atol': atol, 'what': what})}", flush=True)
