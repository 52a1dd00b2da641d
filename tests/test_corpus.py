"""Programs written the way public PyTorch examples are, run unchanged on plain CPU torch and on emulated GPUs.

Each program in tests/corpus/ picks `"cuda" if torch.cuda.is_available() else "cpu"` (and nccl or gloo) as
public scripts do, and ends by printing `RESULT {json}`. It runs twice, each time in a new process: plainly
(CPU), and as under `python -m course --gpus 4` (emulated A100s). Each process is a fork of a Python that has
made the imports such a command line makes first, once for all programs (tests/corpus_zygote.py). The numbers
must agree; a program may widen the tolerance with "_tolerance": [rtol, atol] (bf16 and fp16 programs do).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from corpus_zygote import BWRAP, Zygote

CORPUS = Path(__file__).parent / "corpus"
PROGRAMS = sorted(CORPUS.glob("*.py"))
DEFAULT_TOLERANCE = (1e-4, 1e-5)


# Plain PyTorch, emulator or not: now and then a torchrun rank aborts while its interpreter shuts down, after its
# work is done, as gloo's threads release their last tensors (pytorch/pytorch#179291); torchrun then reports
# the run as failed. Only a run that ended that way is started again.
TEARDOWN_ABORT = "terminate called without an active exception"


def _finish(zygote: Zygote, program: Path, folder: Path, attempts: int = 3) -> tuple[int, str, str]:
    returncode, stdout, stderr = zygote.finish()
    if returncode != 0 and TEARDOWN_ABORT in stderr and attempts > 1:
        zygote.start(program, folder)
        return _finish(zygote, program, folder, attempts - 1)
    return returncode, stdout, stderr


def _result(mode: str, program: Path, finished: tuple[int, str, str]) -> dict:
    returncode, stdout, stderr = finished
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    command = [sys.executable] + (["-m", "course", "--gpus", "4"] if mode == "emulated" else []) + [str(program)]
    assert returncode == 0 and lines, (
        f"{' '.join(command)} exited {returncode} without a RESULT line\n"
        f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def zygotes():
    """The plain and the emulated zygote, the emulated one in its own network when bubblewrap can give it one;
    whether runs of the two may go on at the same time."""
    own_network = bool(BWRAP) and subprocess.run([BWRAP, "--dev-bind", "/", "/", "--unshare-net", "--", "true"],
                                                 capture_output=True).returncode == 0
    pair = {"plain": Zygote("plain"), "emulated": Zygote("emulated", own_network)}
    yield pair, own_network
    for zygote in pair.values():
        zygote.close()


def _plain_and_emulated(program: Path, zygotes, folder: Path) -> tuple[dict, dict]:
    """Both runs of a program: at the same time when the emulated one has its own network (the suite's longest
    part, on a 2-core CI machine), one after the other otherwise."""
    pair, concurrent = zygotes
    if concurrent:
        pair["emulated"].start(program, folder)
        pair["plain"].start(program, folder)
        plain = _finish(pair["plain"], program, folder)
        emulated = _finish(pair["emulated"], program, folder)
        return _result("plain", program, plain), _result("emulated", program, emulated)
    pair["plain"].start(program, folder)
    plain = _result("plain", program, _finish(pair["plain"], program, folder))
    pair["emulated"].start(program, folder)
    return plain, _result("emulated", program, _finish(pair["emulated"], program, folder))


def _compare(plain, emulated, tolerance, path="RESULT") -> list[str]:
    """Every difference between the two results, as readable lines."""
    rtol, atol = tolerance
    if isinstance(plain, bool) or isinstance(plain, str) or plain is None:
        return [] if plain == emulated else [f"{path}: plain {plain!r}, emulated {emulated!r}"]
    if isinstance(plain, (int, float)):
        if not isinstance(emulated, (int, float)) or isinstance(emulated, bool):
            return [f"{path}: plain {plain!r}, emulated {emulated!r}"]
        close = math.isclose(plain, emulated, rel_tol=rtol, abs_tol=atol)
        return [] if close else [f"{path}: plain {plain!r}, emulated {emulated!r}"]
    if isinstance(plain, list):
        if not isinstance(emulated, list) or len(plain) != len(emulated):
            return [f"{path}: plain has {len(plain)} items, emulated {emulated!r}"]
        return [d for i, (p, e) in enumerate(zip(plain, emulated)) for d in _compare(p, e, tolerance, f"{path}[{i}]")]
    if isinstance(plain, dict):
        if not isinstance(emulated, dict) or set(plain) != set(emulated):
            return [f"{path}: keys differ: plain {sorted(plain)}, emulated {sorted(emulated) if isinstance(emulated, dict) else emulated!r}"]
        return [d for key in plain for d in _compare(plain[key], emulated[key], tolerance, f"{path}.{key}")]
    return [f"{path}: cannot compare {type(plain).__name__}"]


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_program_gives_the_same_numbers_on_emulated_gpus(program, zygotes, tmp_path):
    plain, emulated = _plain_and_emulated(program, zygotes, tmp_path)
    tolerance = DEFAULT_TOLERANCE
    if isinstance(plain, dict):
        tolerance = tuple(plain.pop("_tolerance", DEFAULT_TOLERANCE))
    if isinstance(emulated, dict):
        emulated.pop("_tolerance", None)
    assert plain, f"{program.name} printed an empty RESULT: it must report numbers to compare"
    differences = _compare(plain, emulated, tolerance)
    assert not differences, f"{program.name}:\n" + "\n".join(differences[:20])


def test_compare_finds_differences():
    """The comparison itself: equal within tolerance passes, a changed dtype or value does not."""
    assert _compare({"a": [1.0, 2.0], "d": "torch.bfloat16"}, {"a": [1.0, 2.0 + 1e-7], "d": "torch.bfloat16"},
                    DEFAULT_TOLERANCE) == []
    assert _compare({"d": "torch.bfloat16"}, {"d": "torch.float32"}, DEFAULT_TOLERANCE)
    assert _compare({"a": [1.0]}, {"a": [1.1]}, DEFAULT_TOLERANCE)
    assert _compare({"a": [1.0]}, {"a": [1.0, 2.0]}, DEFAULT_TOLERANCE)
