"""autograder/grades.csv: one row per student and assignment, with a status, never a silent 0.

Scores come from the gradebook (so manual grades, which nbgrader keeps in manual_score, count); the status
comes from the pipeline's own record (autograder/grading_state.json): `graded`, or `failed: <reason>`.
For a failed submission the score column is empty when nothing could be graded, or the points earned
before the failure (a lower bound: look at it) otherwise.
"""
import csv
import sys

from . import COURSE_ID, DB_URL, GRADES_CSV
from .autograde import load_state

FIELDS = ["student", "assignment", "score", "max_score", "status", "needs_manual_grade", "flags"]


def rows() -> list[dict]:
    from nbgrader.api import Gradebook, MissingEntry
    state = load_state()
    out = []
    with Gradebook(DB_URL, COURSE_ID) as gb:
        max_scores = {a.name: a.max_score for a in gb.assignments}
        for key in sorted(state):
            student, assignment = key.split("/", 1)
            info = state[key]
            row = {"student": student, "assignment": assignment, "score": "", "status": info["status"],
                   "max_score": max_scores.get(assignment, ""), "needs_manual_grade": "", "flags": "; ".join(info.get("flags", []))}
            nothing = any(w in info["status"] for w in ("missing", "misnamed", "corrupt", "unknown", "sandbox error", "grader error"))
            if not nothing:
                try:
                    sub = gb.find_submission(assignment, student)
                    row.update(score=round(sub.score, 2), needs_manual_grade=sub.needs_manual_grade)
                except MissingEntry:
                    row["status"] = "failed: not in gradebook"
            out.append(row)
    return out


def grades() -> int:
    table = rows()
    with open(GRADES_CSV, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(table)
    failed = sum(r["status"].startswith("failed") for r in table)
    print(f"{GRADES_CSV}: {len(table)} rows, {failed} failed", file=sys.stderr)
    return 0
