"""The student versions as learners meet them: every exercise cell lets Run All go on, and the references stay hidden.
(That notebooks/ is exactly what `make student` generates is checked by tests/test_round_trip.py; Run All of every
untouched and answered student notebook, in JupyterLab, by tests/test_browser.py.)

That every solution passes its tests is shown by nbval (`make test` runs it over solutions/: a failing test cell
is an error output nbval rejects) and, with the untouched student versions scoring zero, by the sandboxed
pipeline in tests/test_round_trip.py.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())


def _env() -> dict:
    """A learner's environment: the venv first, and no autograder/ (with the references) on the path."""
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    return env


def test_there_are_chapters():
    assert CHAPTERS, "no solutions/<chapter>/<chapter>.ipynb found"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_exercise_cell_lets_run_all_go_on(chapter):
    """JupyterLab's Run All stops at the first error unless the failing cell is tagged raises-exception."""
    import nbformat

    notebook = nbformat.read(ROOT / "solutions" / chapter / f"{chapter}.ipynb", as_version=4)
    untagged = [cell.metadata["nbgrader"]["grade_id"] for cell in notebook.cells
                if cell.cell_type == "code" and (cell.metadata.get("nbgrader", {}).get("solution")
                                                 or cell.metadata.get("nbgrader", {}).get("grade"))
                and "raises-exception" not in cell.metadata.get("tags", [])]
    assert not untagged, f"exercise cells without the raises-exception tag: {untagged}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_student_version_has_no_hidden_tests_or_solutions(chapter):
    text = (ROOT / "notebooks" / chapter / f"{chapter}.ipynb").read_text()
    for marker in ("BEGIN HIDDEN TESTS", "BEGIN SOLUTION", "from grading import", "references("):
        assert marker not in text


def test_references_are_not_importable_where_learners_work():
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('references') is not None)"
    for folder in [ROOT / "notebooks", ROOT, *(ROOT / "notebooks").glob("*/")]:
        result = subprocess.run([sys.executable, "-c", probe], cwd=folder, env=_env())
        assert result.returncode == 0, f"references importable from {folder}"
