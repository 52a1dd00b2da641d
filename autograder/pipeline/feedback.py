"""Feedback HTML per student: their answers and results, never the hidden tests' source.

nbgrader's generate_feedback copies test cells verbatim (hidden tests included) and error tracebacks quote
the failing hidden line with its neighbours. So a preprocessor runs before the HTML export: in grade cells
the hidden region becomes one comment line, and a traceback shrinks to its last line (`AssertionError: msg`,
the message the test author wrote for the learner).
"""
import re
import sys

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.preprocessors import GetGrades, NbGraderPreprocessor

from . import AUTOGRADED, FEEDBACK, chapters, nbgrader_api

HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS.*?(^[ \t]*### END HIDDEN TESTS[^\n]*$|\Z)", re.M | re.S)
PLACEHOLDER = "# (hidden tests: not shown)"


class HideTests(NbGraderPreprocessor):
    def preprocess_cell(self, cell, resources, index):
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade"):
            cell.source = HIDDEN.sub(PLACEHOLDER, cell.source)
            for out in cell.get("outputs", []):
                if out.output_type == "error":
                    out.traceback = [f"{out.ename}: {out.evalue}"]
        return cell, resources


def feedback() -> int:
    api = nbgrader_api(GenerateFeedback={"preprocessors": [GetGrades, HideTests, CSSHTMLHeaderPreprocessor]})
    bad = 0
    graded = {p.name for p in AUTOGRADED.glob("*/*") if p.is_dir()}
    for assignment in [a for a in chapters() if a in graded]:
        result = api.generate_feedback(assignment, force=True)
        if not result.get("success", False):
            bad += 1
            print(f"{assignment}: {result.get('error') or result.get('log', '')[-500:]}", file=sys.stderr)
    leaks = [p for p in FEEDBACK.rglob("*.html") if any(  # markers only: learner code may name grading too
        s in p.read_text(errors="replace") for s in ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS"))]
    for p in leaks:  # belt and braces: never hand out a file that still shows hidden tests
        p.unlink()
        print(f"removed {p}: hidden test source leaked into it", file=sys.stderr)
    print(f"feedback in {FEEDBACK}/<student>/<assignment>/", file=sys.stderr)
    return 1 if bad or leaks else 0
