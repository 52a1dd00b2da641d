"""The instructor's grading pipeline: collect -> autograde (sandboxed, parallel) -> feedback -> grades.

Run from the repository root as `python -m autograder.pipeline <command>` (the Makefile does). nbgrader
stays the bookkeeper (gradebook, test-cell restoration, scoring); this package only adds what nbgrader
lacks: a sandbox per submission, parallelism, a status per submission, and feedback without hidden tests.
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the code: this repo, its .venv and course/
# The course data (solutions/, autograder/ with gradebook, submissions, references): this repo, unless
# GRADER_COURSE_DIR points elsewhere (the tests grade a throw-away copy so real grades are never touched).
COURSE = Path(os.environ.get("GRADER_COURSE_DIR") or ROOT).resolve()
SOLUTIONS = COURSE / "solutions"
AUTOGRADER = COURSE / "autograder"
SUBMITTED = AUTOGRADER / "submitted"
AUTOGRADED = AUTOGRADER / "autograded"
FEEDBACK = AUTOGRADER / "feedback"
REFERENCES = AUTOGRADER / "references"
GRADEBOOK = AUTOGRADER / "gradebook.db"
STATE = AUTOGRADER / "grading_state.json"
GRADES_CSV = AUTOGRADER / "grades.csv"
DB_URL = "sqlite:///" + str(GRADEBOOK)
COURSE_ID = "multigpu-course"


def chapters() -> list[str]:
    """Assignment ids: every solutions/<ch>/<ch>.ipynb."""
    return sorted(p.name for p in SOLUTIONS.iterdir() if (p / f"{p.name}.ipynb").exists())


def nbgrader_api(**settings):
    """nbgrader's own API on this course: the repo's nbgrader_config.py, pointed at COURSE's folders and
    gradebook, plus settings such as `GenerateFeedback={"preprocessors": [...]}`. In-process, because every
    `nbgrader` command line pays ~6 s importing (jsonschema's format checkers compile grammars)."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader
    config = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()
    config.Application.log_level = "ERROR"
    config.CourseDirectory.root = str(COURSE)
    config.CourseDirectory.db_url = DB_URL
    for section, values in settings.items():
        for key, value in values.items():
            setattr(config[section], key, value)
    return NbGraderAPI(config=config)
