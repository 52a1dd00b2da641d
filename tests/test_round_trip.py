"""Every chapter through the instructor's own pipeline, as a workshop would run it: `release`, an LMS zip of
what two learners handed in (one answered every exercise as the solutions do, one changed nothing),
`collect`, sandboxed `autograde`, `grades` and `feedback`. Full marks and zero, chapter by chapter.

Runs in a throw-away course folder (GRADER_COURSE_DIR), so the real gradebook is never touched.
"""
import csv
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from autograder.pipeline import synthetic  # noqa: E402

CHAPTERS = sorted(p.name for p in (ROOT / "solutions").iterdir() if (p / f"{p.name}.ipynb").exists())
HANDED_IN = (2026, 11, 20, 17, 5, 0)  # the LMS's receipt time, kept in the zip
EARLIER = (2026, 11, 20, 9, 0, 0)
BAD_MEMBERS = {"ada_notes.txt": {}, "carol_99_quantum_gpus.ipynb": {},  # not a notebook name; an unknown assignment
               f"early/ada_{CHAPTERS[0]}.ipynb": {"cells": []}}  # an earlier attempt, stored after the final one

pytestmark = pytest.mark.needs("sandbox")  # fails without it unless ALLOW_SKIP=1 (tests/conftest.py)


@pytest.fixture(scope="module")
def workshop(tmp_path_factory, expected_results):
    course = tmp_path_factory.mktemp("workshop")
    shutil.copytree(ROOT / "solutions", course / "solutions")
    shutil.copytree(ROOT / "autograder" / "references", course / "autograder" / "references")
    (course / "autograder" / "expected").symlink_to(expected_results)  # shared, see tests/conftest.py
    shutil.copy(ROOT / "nbgrader_config.py", course)
    (course / "notebooks").mkdir()
    shutil.copy(ROOT / "notebooks" / "README.md", course / "notebooks")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               GRADER_COURSE_DIR=str(course))
    env.pop("PYTHONPATH", None)

    def pipeline(*args):
        r = subprocess.run([sys.executable, "-m", "autograder.pipeline", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stderr

    pipeline("release")
    released = zipfile.ZipFile(course / "autograder" / "release.zip")
    export = course / "lms_export.zip"
    with zipfile.ZipFile(export, "w") as z:
        for chapter in CHAPTERS:
            student_nb = json.loads(released.read(f"{chapter}/{chapter}.ipynb"))
            solution_nb = json.loads((ROOT / "solutions" / chapter / f"{chapter}.ipynb").read_text())
            full = synthetic.answered(student_nb, synthetic.solution_answers(solution_nb))
            for learner, nb in (("ada", full), ("bob", student_nb)):
                z.writestr(zipfile.ZipInfo(f"{learner}_{chapter}.ipynb", HANDED_IN), json.dumps(nb))
        for name, nb in BAD_MEMBERS.items():  # what collect must report, not silently drop or grade
            z.writestr(zipfile.ZipInfo(name, EARLIER), json.dumps(nb))
    collected = pipeline("collect", str(export))
    log = pipeline("autograde")
    pipeline("grades")
    pipeline("feedback")
    rows = {(r["student"], r["assignment"]): r for r in csv.DictReader(open(course / "autograder" / "grades.csv"))}
    return {"course": course, "rows": rows, "released": released.namelist(), "log": log, "collected": collected}


def test_collect_reports_what_it_cannot_place_and_keeps_the_latest_attempt(workshop):
    log = workshop["collected"]
    assert "ada_notes.txt: file name not understood" in log, log
    assert "carol_99_quantum_gpus.ipynb: unknown assignment '99_quantum_gpus'" in log, log
    assert f"early/ada_{CHAPTERS[0]}.ipynb: ada handed in {CHAPTERS[0]} again later" in log, log
    assert f"collected {2 * len(CHAPTERS)} notebooks" in log and "3 problems" in log, log
    assert not (workshop["course"] / "autograder" / "submitted" / "carol").exists()


def test_release_zip_holds_every_chapter(workshop):
    assert set(workshop["released"]) == {f"{c}/{c}.ipynb" for c in CHAPTERS} | {"README.md"}


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_committed_student_notebooks_are_what_release_generates(workshop, chapter):
    generated = workshop["course"] / "notebooks" / chapter / f"{chapter}.ipynb"
    committed = ROOT / "notebooks" / chapter / f"{chapter}.ipynb"
    assert committed.exists(), f"notebooks/{chapter} is missing: run `make student`"
    assert json.loads(generated.read_text()) == json.loads(committed.read_text()), (
        f"notebooks/{chapter} is stale: run `make student` and commit the result")


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_solutions_get_full_marks(workshop, chapter):
    row = workshop["rows"][("ada", chapter)]
    assert row["status"] == "graded" and float(row["score"]) == float(row["max_score"]) > 0, row
    assert row["flags"] == "", f"an honest submission flagged for review: {row['flags']}"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_untouched_notebooks_get_zero(workshop, chapter):
    row = workshop["rows"][("bob", chapter)]
    assert row["status"] == "graded" and float(row["score"]) == 0 and row["flags"] == "", row


def test_submission_times_come_from_the_lms_export(workshop):
    from nbgrader.api import Gradebook
    with Gradebook("sqlite:///" + str(workshop["course"] / "autograder" / "gradebook.db"), "multigpu-course") as gb:
        stamp = gb.find_submission(CHAPTERS[0], "ada").timestamp
    assert stamp.timetuple()[:6] == HANDED_IN


def test_feedback_for_every_submission_without_hidden_tests(workshop):
    pages = list((workshop["course"] / "autograder" / "feedback").rglob("*.html"))
    assert len(pages) == 2 * len(CHAPTERS)
    for page in pages:
        text = page.read_text()
        assert "BEGIN HIDDEN TESTS" not in text and "from grading import" not in text, page
