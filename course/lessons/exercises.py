"""Helpers for the chapters' exercises, so a notebook runs past exercises the learner has not done yet.

A demo cell that calls a learner's function starts with

    if demo_needs(tiled_forward):
        ...

and prints "Finish the exercise `tiled_forward` to see this." instead of failing while the function is
still the stub nbgrader leaves (`raise NotImplementedError()`). A value the learner must set (a prediction)
is defined as None in a cell before the exercise, so later cells can pass it too: `demo_needs(predicted_ms)`.
"""
from __future__ import annotations

import ast
import inspect
import textwrap


def is_unfinished(thing) -> bool:
    """True for None, for a function whose body (after its docstring) is only `raise NotImplementedError...`,
    and for a class (an exercise that asks for one) with such a method among those it defines."""
    if thing is None:
        return True
    if inspect.isclass(thing):
        return any(is_unfinished(member) for member in vars(thing).values() if inspect.isfunction(member))
    if not callable(thing):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(thing)))
    except (OSError, TypeError, SyntaxError):  # no source to read: judge by what the code refers to
        code = getattr(thing, "__code__", None)
        return code is not None and "NotImplementedError" in code.co_names and len(code.co_names) <= 2
    function = tree.body[0] if tree.body else None
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    raised = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


_PREDICTION = "the prediction above"


def _name(thing) -> str:
    return getattr(thing, "__name__", None) or _PREDICTION


def demo_needs(*things) -> bool:
    """True when every function or value a demo uses is done; otherwise print which exercise to finish.

    `things` are the learner's functions (unfinished while their body is still the stub) or values
    (unfinished while None). Use it as `if demo_needs(f, g): ...` so Run All goes on past the demo.
    """
    missing = [_name(thing) for thing in things if is_unfinished(thing)]
    if missing:
        names = [f"`{name}`" for name in missing if name != _PREDICTION]
        todo = []
        if names:
            todo.append(f"finish the exercise{'s' if len(names) > 1 else ''} {', '.join(names)}")
        if len(names) < len(missing):
            todo.append("set your prediction above")
        message = " and ".join(todo)
        print(f"{message[:1].upper()}{message[1:]} to see this.")  # not capitalize(): it lowercases `Zero1Adam`
        return False
    return True


def check_prediction(predicted, measured: float, rtol: float, unit: str = "", hint: str = "") -> None:
    """The visible test of a "predict, then measure" exercise: `predicted` within `rtol` of `measured`.

    Fails with how far off the prediction is and in which direction (not the measured value itself), plus
    `hint`; a passing prediction prints how close it came.
    """
    assert predicted is not None, "set your prediction first (it is still None)"
    assert isinstance(predicted, (int, float)) and not isinstance(predicted, bool), (
        f"the prediction must be a number{f' of {unit}' if unit else ''}; got {type(predicted).__name__}")
    off = predicted / measured - 1
    direction = "too high" if off > 0 else "too low"
    if abs(off) > rtol:
        ratio = predicted / measured
        if ratio >= 2 or 0 < ratio <= 0.5:
            how = f"{max(ratio, 1 / ratio):.3g} times {direction}"
        else:
            how = f"{abs(off):.0%} {direction}"
        raise AssertionError(f"your prediction is {how}; the test accepts {rtol:.0%} either way. {hint}".rstrip())
    closeness = "matches it to within 0.05%" if abs(off) < 0.0005 else f"{abs(off):.1%} {direction}"
    print(f"Prediction within {rtol:.0%} of the measurement: {closeness}.")
