"""Submissions made from a chapter's own notebooks, for the benchmark and the tests of this pipeline.

A learner who answers exactly as the instructor did hands in the released (student) notebook with each answer
cell replaced by the solution's code, markers removed; one who changes nothing hands it in as released.
"""
import copy


def solution_answers(solution_nb: dict) -> dict[str, str]:
    """grade_id -> the instructor's answer, without nbgrader's BEGIN/END SOLUTION marker lines."""
    return {c["metadata"]["nbgrader"]["grade_id"]: "".join(
                ln for ln in "".join(c["source"]).splitlines(True)
                if "### BEGIN SOLUTION" not in ln and "### END SOLUTION" not in ln)
            for c in solution_nb["cells"] if c["metadata"].get("nbgrader", {}).get("solution")}


def answered(student_nb: dict, answers: dict[str, str]) -> dict:
    """A copy of the released notebook with the given answer cells (grade_id -> source) filled in."""
    nb = copy.deepcopy(student_nb)
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if cell["metadata"].get("nbgrader", {}).get("solution") and grade_id in answers:
            cell["source"] = answers[grade_id]
    return nb
