"""The chapters as nbgrader sees them: student versions are fresh and fail every test, references stay hidden.

Runs the real nbgrader (and so real Jupyter kernels). That every solution passes its tests is shown
by nbval (`make test` runs it over solutions/): a failing test cell is an error output nbval rejects.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())


def _env(grading: bool) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    if grading:
        env["PYTHONPATH"] = str(ROOT / "autograder")
    return env


def _nbgrader(*args, cwd=ROOT, grading=True, timeout=600) -> str:
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=_env(grading),
                            capture_output=True, text=True, timeout=timeout)
    return result.stdout + result.stderr


def test_there_are_chapters():
    assert CHAPTERS, "no solutions/<chapter>/<chapter>.ipynb found"


def test_student_notebooks_are_exactly_what_make_student_generates(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    shutil.copy(ROOT / "nbgrader_config.py", tmp_path)
    (tmp_path / "autograder").mkdir()  # where the config keeps the gradebook
    for chapter in CHAPTERS:
        log = _nbgrader("generate_assignment", chapter, "--force", cwd=tmp_path, grading=False)
        generated = tmp_path / "notebooks" / chapter / f"{chapter}.ipynb"
        assert generated.exists(), log
        committed = ROOT / "notebooks" / chapter / f"{chapter}.ipynb"
        assert committed.exists(), f"notebooks/{chapter} is missing: run `make student`"
        assert json.loads(generated.read_text()) == json.loads(committed.read_text()), (
            f"notebooks/{chapter} is stale: run `make student` and commit the result")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_untouched_student_version_fails_every_test(chapter):
    log = _nbgrader("validate", "--invert", f"notebooks/{chapter}/{chapter}.ipynb")
    assert "Success! The notebook does not pass any tests." in log, log


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_nothing_errors_before_the_first_exercise(chapter):
    """Run the student version up to its first answer cell, as a learner would: no cell may fail."""
    import nbclient
    import nbformat

    notebook = nbformat.read(ROOT / "notebooks" / chapter / f"{chapter}.ipynb", as_version=4)
    first_answer = next(i for i, cell in enumerate(notebook.cells)
                        if cell.metadata.get("nbgrader", {}).get("solution"))
    notebook.cells = notebook.cells[:first_answer]
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks" / chapter)}})
    client.execute(env=_env(grading=False))  # raises CellExecutionError at the first failing cell


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_student_version_has_no_hidden_tests_or_solutions(chapter):
    text = (ROOT / "notebooks" / chapter / f"{chapter}.ipynb").read_text()
    for marker in ("BEGIN HIDDEN TESTS", "BEGIN SOLUTION", "from references"):
        assert marker not in text


def test_references_are_not_importable_where_learners_work():
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('references') is not None)"
    for folder in [ROOT / "notebooks", ROOT, *(ROOT / "notebooks").glob("*/")]:
        result = subprocess.run([sys.executable, "-c", probe], cwd=folder, env=_env(grading=False))
        assert result.returncode == 0, f"references importable from {folder}"
