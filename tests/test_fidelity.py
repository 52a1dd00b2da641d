"""Regression test of the calibration: the emulator's clock against published measurements of real GPUs."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import fidelity  # noqa: E402


def test_emulator_matches_published_measurements():
    rows = fidelity.rows()
    assert all(row.source.strip() for row in rows), "every row needs a source"
    assert any(not row.calibrated for row in rows), "some rows must be independent of the calibration"
    s = fidelity.summary(rows)
    worst = max(rows, key=lambda r: abs(r.error_pct))
    assert s["median"] <= 10, s
    assert s["worst"] <= 25, f"{worst.what} on {worst.hardware}: {worst.error_pct:+.1f}%"
