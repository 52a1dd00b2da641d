"""`grading.check`, what hidden tests call, and the comparison the pipeline makes outside the learner's kernel."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "autograder")]  # the repo, and references/ as hidden tests import it
from autograder import grading  # noqa: E402
from autograder.pipeline import expected  # noqa: E402


@pytest.fixture
def mode():
    """Switch grading's mode for one test (the guard calls configure in the sandbox), then put it back."""
    before = grading.MODE, grading.MARKER
    yield grading.configure
    grading.configure(*before)


def _records(capsys, marker):
    return [json.loads(line.split(" check ", 1)[1]) for line in capsys.readouterr().out.splitlines()
            if line.startswith(f"{marker} check ")]


def test_learner_mode_records_the_result_and_never_calls_the_reference(mode, capsys):
    mode("learner", "NONCE")
    called = []
    grading.check([1, 2.5, "x", None], lambda: called.append(1))
    assert not called, "the reference must not run in the learner's kernel"
    assert _records(capsys, "NONCE") == [{"got": [1, 2.5, "x", None]}]
    with pytest.raises(RuntimeError, match="trusted run"):
        grading.references("sharded_matmul").sharded_matmul_forward()


def test_trusted_mode_asserts_the_solution_and_prints_what_is_expected(mode, capsys):
    mode("trusted", "EXPECT")
    grading.check(1.0 + 1e-12, lambda: 1.0, rtol=1e-9, what="one")
    assert _records(capsys, "EXPECT") == [{"want": 1.0, "rtol": 1e-9, "atol": 0.0, "what": "one"}]
    with pytest.raises(AssertionError, match="the solution gives 2"):
        grading.check(2, 3)
    assert grading.references("sharded_matmul").__name__ == "references.sharded_matmul"


@pytest.mark.parametrize("got,want,rtol,atol,same", [
    (1.0, 1.0 + 1e-10, 1e-9, 0, True),
    (1.0, 1.1, 1e-9, 0, False),
    (3, 3, 0, 0, True),
    (3, 3.0000001, 1e-6, 0, True),
    (True, 1, 0, 0, False),  # a bool is not a number here
    (None, 0, 0, 0, False),
    ((1, 2), [1, 2], 0, 0, True),  # tuples and lists record alike
    ([1, 2], [1, 2, 3], 0, 0, False),
    ({"a": 1.0, (1, 2): "b"}, {(1, 2): "b", "a": 1.0}, 0, 0, True),
    ({"a": 1.0}, {"a": 1.0, "b": 2}, 0, 0, False),
    (float("nan"), float("nan"), 0, 0, True),
    (float("inf"), 1e308, 0, 1e300, False),
    (np.float64(0.5), 0.5, 0, 0, True),
    (torch.device("cuda", 1), torch.device("cuda:1"), 0, 0, True),
    (torch.float16, torch.float32, 0, 0, False),
    ("data", "tensor", 0, 0, False),
])
def test_matches(got, want, rtol, atol, same):
    assert grading.matches(grading.encode(got), grading.encode(want), rtol, atol) is same


def test_tensors_compare_like_allclose_with_shape_and_dtype():
    a = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    enc = grading.encode
    assert grading.matches(enc(a + 1e-7), enc(a), 0, 1e-6)
    assert not grading.matches(enc(a + 1e-3), enc(a), 0, 1e-6)
    assert not grading.matches(enc(a.reshape(4, 3)), enc(a), 0, 1)
    assert not grading.matches(enc(a.double()), enc(a), 0, 1)
    assert grading.matches(enc(torch.tensor([math.inf, 1])), enc(torch.tensor([math.inf, 1])))
    with pytest.raises(TypeError, match="record numbers"):
        enc(object())


def test_emulated_gpu_tensors_must_be_moved_to_the_cpu_first():
    import course
    with course.emulate(gpus=1, force=True):
        with pytest.raises(TypeError, match=r"call \.cpu\(\)"):
            grading.encode(torch.ones(2, device="cuda:0"))


def test_verdicts_need_every_check_in_order_with_the_trusted_tolerance():
    want = [{"want": 1.0, "rtol": 0.25, "atol": 0.0, "what": "predicted_ms"}, {"want": [1, 2], "rtol": 0, "atol": 0}]
    assert expected.verdicts(want, [{"got": 1.2}, {"got": [1, 2]}]) is None
    assert "hidden check 1 of 2 (predicted_ms): the result differs" in expected.verdicts(want, [{"got": 1.3}, {"got": [1, 2]}])
    assert "hidden check 2 of 2 was not recorded" in expected.verdicts(want, [{"got": 1.0}])
    assert "3 hidden checks recorded, 2 expected" in expected.verdicts(want, [{"got": 1.0}, {"got": [1, 2]}, {"got": 0}])
    # a learner's record cannot bring its own tolerance or expected value
    assert expected.verdicts(want, [{"got": 9.0, "rtol": 100, "want": 9.0}, {"got": [1, 2]}]) is not None
