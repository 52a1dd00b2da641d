"""Regression test of the clock against published measurements of real GPUs, judged on the held-out half.

benchmarks/fidelity.py splits its rows into a calibration half (presets may be fitted to it) and a held-out
half (they may not). Only the held-out error says how right the clock is where it was not fitted, so the
bounds below are on that half; the calibration half must merely stay where it was fitted.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import fidelity  # noqa: E402


def test_rows_are_sourced_many_and_split_by_the_fixed_rule():
    rows = fidelity.assign_halves(fidelity._rows())
    assert len(rows) >= 40
    assert all(row.source.strip() and row.what.strip() and row.hardware.strip() for row in rows)
    halves = {row.half for row in rows}
    assert halves == {fidelity.CALIBRATION, fidelity.HELD_OUT}
    assert all(row.half == fidelity.CALIBRATION for row in rows if row.fitted_before or row.fitted_later)
    assert all(row.half == fidelity.HELD_OUT for row in rows if row.added_later)  # checks on later model changes
    held_out = [row for row in rows if row.half == fidelity.HELD_OUT]
    assert len(held_out) >= len(rows) // 3
    assert len({row.category for row in held_out}) >= 5  # the held-out half spans the kinds of work


def test_emulator_matches_published_measurements_it_was_not_fitted_to():
    rows = fidelity.rows()
    s = fidelity.summary(rows)
    held_out = [r for r in rows if r.half == fidelity.HELD_OUT]
    # Issue 15's targets for an unseen table: median <= 10% (measured 6.7% over 61 held-out rows) and worst <= 35%
    # (measured 33.4%: an NVSwitch bidirectional copy between GPUs 3 and 4 of an HGX A100).
    assert s["held_out_median"] <= 10, s
    for row in held_out:
        assert abs(row.error_pct) <= 35, f"{row.what} on {row.hardware}: {row.error_pct:+.1f}%"
    # The points presets were fitted to before the split stay as good as they were.
    for row in rows:
        if row.fitted_before:
            assert abs(row.error_pct) <= 2, f"{row.what} on {row.hardware}: {row.error_pct:+.1f}%"


def test_batch1_decode_uses_less_of_a_faster_gpus_memory_floor():
    """Batch-1 decode streams every weight once per token: an L4 runs close to that memory floor, while an H100
    finishes its GPU work sooner than the host can issue the ops, so it reaches a smaller fraction of it (the
    measurement in arXiv 2605.30571 that the eager host model reproduces)."""
    l4, h100 = fidelity.qwen_decode_floor_fraction("L4"), fidelity.qwen_decode_floor_fraction("H100")
    assert 0.5 < l4 < 1
    assert h100 < 0.7 * l4
