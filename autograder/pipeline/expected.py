"""The expected results of every hidden check: the chapter's hidden tests run once on its solution notebook.

This is the trusted run of `autograder/grading.py`: outside any sandbox, with the reference implementations
importable, every `check()` compares the solution with its reference and prints what a learner's result must
match. The pipeline keeps those per test cell in `autograder/expected/<chapter>.json` and reruns a chapter
only when its solution, the references, the course package or grading.py change. After each sandboxed run
`verdicts()` compares the learner's recorded results with them, outside the kernel.

`python -m autograder.pipeline selfcheck [CHAPTER ...]` checks a chapter after its tests were edited: the
solution passes in the trusted run and, run as a learner's kernel would run it, records results that match.
"""
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import AUTOGRADER, REFERENCES, ROOT, SOLUTIONS

EXPECTED = AUTOGRADER / "expected"
GRADING = ROOT / "autograder" / "grading.py"


def fingerprint(chapter: str) -> str:
    """What the expected results depend on: the solution, the references, grading.py and the course package."""
    h = hashlib.sha256()
    files = [SOLUTIONS / chapter / f"{chapter}.ipynb", GRADING, *sorted(REFERENCES.glob("*.py")),
             *sorted((ROOT / "course").rglob("*.py"))]
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def execute(notebook: Path, mode: str) -> tuple[dict, str]:
    """Run a notebook top to bottom in a fresh, unsandboxed kernel with grading.py in `mode`; returns
    (executed notebook as a dict, the marker its checks printed). Trusted code only: solution notebooks."""
    marker = "EXPECT-" + secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="mgpu-expected-") as tmp:
        out = Path(tmp) / "executed.ipynb"
        paths = dict.fromkeys([str(REFERENCES.parent), str(GRADING.parent)])  # references may be a course copy's
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), MPLBACKEND="Agg", GRADER_MODE=mode,
                   GRADER_MARKER=marker)
        r = subprocess.run([sys.executable, "-m", "autograder.pipeline.expected", str(notebook), str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"running {notebook} failed: {r.stderr.strip()[-500:]}")
        return json.loads(out.read_text()), marker


def _text(out: dict) -> str:
    text = out.get("text", "")
    return text if isinstance(text, str) else "".join(text)


def records(cell: dict, marker: str) -> list[dict]:
    """The check records a cell printed on marker lines, in order."""
    found = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            for line in _text(out).split("\n"):
                if line.startswith(f"{marker} check "):
                    found.append(json.loads(line[len(marker) + 7:]))
    return found


def graded_cells(nb: dict) -> dict[str, dict]:
    """grade_id -> test cell (a code cell nbgrader grades)."""
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in nb["cells"]
            if c["cell_type"] == "code" and c["metadata"].get("nbgrader", {}).get("grade")}


def compute(chapter: str) -> dict:
    """Run the solution's hidden tests in trusted mode: {grade_id: [{want, rtol, atol, what}, ...]}."""
    nb, marker = execute(SOLUTIONS / chapter / f"{chapter}.ipynb", "trusted")
    expected = {}
    for grade_id, cell in graded_cells(nb).items():
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            raise RuntimeError(f"solutions/{chapter}: the solution fails its own test {grade_id}: "
                               f"{errors[0]['ename']}: {errors[0]['evalue'][:300]}")
        expected[grade_id] = records(cell, marker)
    return expected


def load(chapter: str) -> dict:
    """The chapter's expected results, from the cache when nothing they depend on changed."""
    path, digest = EXPECTED / f"{chapter}.json", fingerprint(chapter)
    try:
        cached = json.loads(path.read_text())
        if cached["fingerprint"] == digest:
            return cached["tests"]
    except (OSError, ValueError, KeyError):
        pass
    tests = compute(chapter)
    EXPECTED.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": digest, "tests": tests}, indent=1))
    tmp.replace(path)
    return tests


def load_all(wanted: list[str], jobs: int = 2) -> dict[str, dict | str]:
    """{chapter: expected results, or the reason there are none}, stale chapters recomputed `jobs` at a time."""
    def one(chapter):
        try:
            return load(chapter)
        except Exception as e:  # reported per chapter; its submissions fail and are retried next run
            return f"{type(e).__name__}: {e}"
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return dict(zip(wanted, pool.map(one, wanted)))


def verdicts(expected: list[dict], got: list[dict]) -> str | None:
    """Why a test cell's recorded results fail its expected ones, or None when every check matches."""
    from autograder import grading
    for i, want in enumerate(expected, 1):
        label = f"hidden check {i} of {len(expected)}" + (f" ({want['what']})" if want.get("what") else "")
        if i > len(got):
            return f"{label} was not recorded"
        if "got" not in got[i - 1] or not grading.matches(got[i - 1]["got"], want["want"], want["rtol"], want["atol"]):
            return f"{label}: the result differs from the reference"
    if len(got) > len(expected):
        return f"{len(got)} hidden checks recorded, {len(expected)} expected"
    return None


def selfcheck(wanted: list[str], notebook: Path | None = None) -> int:
    """Trusted run, then the solution run as a learner's kernel would run it: every check must match.

    With `notebook` (a copy of one chapter's solution with some answers changed), that copy is run instead
    and compared: a way to see that the hidden tests catch a given wrong answer."""
    bad = 0
    for chapter in wanted:
        try:
            expected = compute(chapter)
            nb, marker = execute(notebook or SOLUTIONS / chapter / f"{chapter}.ipynb", "learner")
        except RuntimeError as e:
            print(f"{chapter}: {e}")
            bad += 1
            continue
        for grade_id, cell in graded_cells(nb).items():
            why = verdicts(expected[grade_id], records(cell, marker))
            count = len(expected[grade_id])
            errors = [f"{o['ename']}: {o['evalue'][:200]}" for o in cell.get("outputs", []) if o.get("output_type") == "error"]
            why = errors[0] if errors else why or (None if count else "no hidden checks recorded")
            print(f"{chapter} {grade_id}: {why or f'ok ({count} hidden checks)'}")
            bad += bool(why)
    return 1 if bad else 0


def _run(notebook: Path, out: Path) -> None:
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(notebook, as_version=4)
    NotebookClient(nb, timeout=600, allow_errors=True, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook.parent)}}).execute()
    nbformat.write(nb, out)


if __name__ == "__main__":
    _run(Path(sys.argv[1]), Path(sys.argv[2]))
