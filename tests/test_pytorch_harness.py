"""Test files written with PyTorch's own test harness (torch.testing._internal: TestCase, the device-type
framework, MultiProcessTestCase), run unchanged under `python -m course --gpus 4`.

On a CPU-only torch their CUDA tests are skipped; on emulated GPUs they must run and pass. Each test compares GPU
results with CPU torch inside it, as PyTorch's tests do. The emulated box reports cuDNN (course/cuda/build_info.py),
so `skipCUDAIfNoCudnn` tests run too; the only skips expected are the CPU copies of CUDA-only tests. Each file
runs as `python -m course --gpus 4 FILE -v` does, forked from a Python that made that command's imports once.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from corpus_zygote import Zygote

HARNESS = Path(__file__).parent / "pytorch_harness"
FILES = sorted(HARNESS.glob("*.py"))
EXPECTED_SKIPS = {"Only runs on cuda"}  # CUDA-only tests instantiated for the CPU beside the CUDA ones


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """An emulated corpus zygote (tests/corpus_zygote.py): each file runs as a fork of a Python that has imported
    torch and the course once, as `python -m course` would run it. The harness's own imports (common_utils reads
    torch.cuda.is_available() as it is imported) happen in each run, after the emulated machine has started."""
    # CI=true (as .ci/run sets it) makes PyTorch's harness write JUnit XML through xmlrunner, which is PyTorch's
    # own CI's dependency, not a course one.
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_EMULATE", "CI")}
    temp = tmp_path_factory.mktemp("harness-temp")
    env.update(PYTHONWARNINGS="ignore", TEMP_DIR=str(temp), TMPDIR=str(temp))
    zygote = Zygote("emulated", env=env)
    yield zygote
    zygote.close()


@pytest.mark.slow
@pytest.mark.parametrize("test_file", FILES, ids=[f.stem for f in FILES])
def test_runs_and_passes_on_emulated_gpus(test_file, zygote, tmp_path):
    zygote.start(test_file, tmp_path, args=("-v",), cwd=tmp_path)
    returncode, _, report = zygote.finish()
    assert returncode == 0 and "\nOK" in report, f"{test_file.name}:\n{report[-4000:]}"
    ran = int(re.search(r"Ran (\d+) test", report).group(1))
    skips = re.findall(r"\.\.\. skipped '([^']*)'", report)
    assert set(skips) <= EXPECTED_SKIPS, f"{test_file.name} skipped tests it should run: {skips}"
    assert ran - len(skips) >= 1, f"{test_file.name}: only {ran - len(skips)} tests ran"
