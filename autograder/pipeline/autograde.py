"""Autograde every submission under autograder/submitted/, two at a time, each kernel sandboxed (sandbox.py).

nbgrader's `autograde` runs the kernel in-process with the gradebook next to it and grades one notebook at a
time; here its own preprocessors are split around a sandboxed execution:
  outside, before:  ClearOutput, DeduplicateIds, OverwriteKernelspec, OverwriteCells(add_missing_cells),
                    CheckCellMetadata  (test cells restored from the gradebook; deleted ones put back)
  inside:           the cells run one by one in a sandboxed kernel (sandbox.py), guard.py loaded first;
                    hidden tests only record the learner's results (grading.py, learner mode)
  outside, after:   verdicts applied: test cells that were tampered with, not run, or whose recorded results
                    differ from the expected ones (expected.py: the same tests run on the solution) get an
                    error output; then IgnorePattern, LimitOutput, SaveAutoGrades, AssignLatePenalties,
                    CheckCellMetadata
Only the parent process writes the gradebook (serialized, no sqlite lock fights); it post-processes one
notebook while the slot that ran it already executes the next. A submission whose files (and the
chapter's solution, references and course package) are unchanged since its last grading is skipped;
SaveAutoGrades only ever sets auto_score, so manual grades survive re-runs.
"""
import hashlib
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from . import AUTOGRADED, COURSE, COURSE_ID, ROOT, DB_URL, SOLUTIONS, STATE, SUBMITTED, chapters, expected, sandbox, scan

# The pipeline's own code: a change to any of it (a new guard rule, say) regrades every submission.
PIPELINE_DIGEST = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py")))).digest()
JUNK = {".ipynb_checkpoints", "__pycache__", ".DS_Store"}


def load_state() -> dict:
    try:
        return json.loads(STATE.read_text())
    except (OSError, ValueError):
        return {}


def save_state(state: dict) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    tmp.replace(STATE)


def fingerprint(folder: Path, chapter_print: str) -> str:
    """Hash of every submitted file plus what the chapter's expected results depend on (`expected.fingerprint`:
    its solution, the references, the course package) and the pipeline's own code: what decides whether a
    grade is stale."""
    h = hashlib.sha256(PIPELINE_DIGEST)
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not JUNK & set(p.parts)):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(chapter_print.encode())
    return h.hexdigest()


def submissions() -> list[tuple[str, str]]:
    if not SUBMITTED.is_dir():
        return []
    return sorted((s.name, a.name) for s in SUBMITTED.iterdir() if s.is_dir() and not s.name.startswith(".")
                  for a in s.iterdir() if a.is_dir() and not a.name.startswith("."))


def _resources(student: str, assignment: str) -> dict:
    return {"nbgrader": {"db_url": DB_URL, "assignment": assignment, "notebook": assignment, "student": student},
            "metadata": {"path": str(COURSE)}}


def _run_preprocessors(nb, resources, classes):
    for cls in classes:
        nb, resources = cls().preprocess(nb, resources)
    return nb, resources


def register(student: str, assignment: str) -> None:
    """Student and submission rows, with the submission time if the LMS export gave one (own session)."""
    from nbgrader.api import Gradebook
    from nbgrader.utils import parse_utc
    stamp = SUBMITTED / student / assignment / "timestamp.txt"
    kwargs = {"timestamp": parse_utc(stamp.read_text().strip())} if stamp.exists() else {}
    with Gradebook(DB_URL, COURSE_ID) as gb:
        gb.update_or_create_student(student)
        gb.update_or_create_submission(assignment, student, **kwargs)


def prepare(student: str, assignment: str, job: Path, slot: "Slot", cell_timeout: int):
    """Sanitized notebook in job/, the slot's sandbox folders refilled; returns (None, flags) or ('failed: ...', flags)."""
    import nbformat
    from nbgrader.preprocessors import (CheckCellMetadata, ClearOutput, DeduplicateIds, OverwriteCells,
                                        OverwriteKernelspec)
    folder = SUBMITTED / student / assignment
    path = folder / f"{assignment}.ipynb"
    if not path.exists():
        others = sorted(p.name for p in folder.rglob("*.ipynb") if not JUNK & set(p.parts))
        return (f"failed: misnamed notebook (found {', '.join(others)}; expected {path.name})" if others
                else "failed: missing notebook"), []
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        if not isinstance(nb.cells, list):
            raise ValueError("no cells")
    except Exception as e:  # any parse/validation error is a corrupt notebook, reported, never a 0
        return f"failed: corrupt notebook ({type(e).__name__})", []
    released = COURSE / "notebooks" / assignment / f"{assignment}.ipynb"
    flags = scan.suspicious(nb, nbformat.read(released, as_version=4) if released.exists() else None)
    OverwriteCells.add_missing_cells = True  # restore deleted test cells too (class-level: no config object)
    try:
        nb, _ = _run_preprocessors(nb, _resources(student, assignment),
                                   [ClearOutput, DeduplicateIds, OverwriteKernelspec, OverwriteCells,
                                    CheckCellMetadata])
    except Exception as e:
        return f"failed: corrupt notebook ({type(e).__name__}: {str(e)[:80]})", flags
    tests = [c.source for c in nb.cells if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    nonce = "GRADER-" + secrets.token_hex(16)
    box = slot.dir
    sandbox.empty(box)
    (box / "ipython/profile_default/startup").mkdir(parents=True)
    for src in (folder, SOLUTIONS / assignment):  # files next to the notebook; master files win
        for extra in src.iterdir():
            if extra.suffix != ".ipynb" and extra.name not in JUNK and extra.name != "timestamp.txt":
                if extra.is_dir():
                    shutil.copytree(extra, box / "inbox" / extra.name, dirs_exist_ok=True)
                else:
                    shutil.copy2(extra, box / "inbox" / extra.name)
    if MPL_CACHE.is_dir():
        shutil.copytree(MPL_CACHE, box / "inbox" / ".mpl", dirs_exist_ok=True)
    shutil.copy(Path(__file__).with_name("guard.py"), box / "ipython/profile_default/startup/00-grader-guard.py")
    (box / "guard" / "guard.json").write_text(json.dumps(
        {"nonce": nonce, "tests": [hashlib.sha256(t.encode()).hexdigest() for t in tests],
         "grading": expected.GRADING.read_text()}))
    job.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, job / "prepared.ipynb")
    (job / "job.json").write_text(json.dumps({"cell_timeout": cell_timeout, "nonce": nonce}))
    sandbox.hand_over(box, slot.index)
    return None, flags


MPL_CACHE = Path(tempfile.gettempdir()) / "mgpu-grading-mpl-cache"


def warm_matplotlib() -> None:
    """Build matplotlib's font cache once; each sandbox gets a copy (else every kernel rebuilds it)."""
    if not (MPL_CACHE / "done").exists():
        MPL_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", "import matplotlib.pyplot"], env=dict(os.environ, MPLCONFIGDIR=str(MPL_CACHE),
                       MPLBACKEND="Agg"), capture_output=True, timeout=300)
        (MPL_CACHE / "done").touch()


class Slot:
    """One worker slot: its sandbox folders and its long-lived worker process (sandbox.serve), which keeps the
    slot's zygote; the worker is (re)started on demand and killed if a notebook overruns the wall timeout."""

    def __init__(self, index: int, base: Path):
        self.index, self.dir, self.proc, self.lines = index, base / f"slot{index}", None, queue.Queue()
        sandbox.empty(self.dir)
        os.chmod(base, 0o755)

    def _start(self):
        log = open(self.dir.parent / f"worker{self.index}.log", "ab") if os.environ.get("GRADER_DEBUG") else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "autograder.pipeline.sandbox", str(self.dir), str(self.index)],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True,
                                     env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        self.lines = queue.Queue()
        threading.Thread(target=lambda out=self.proc.stdout, q=self.lines: [q.put(ln) for ln in out] + [q.put(None)],
                         daemon=True).start()

    def execute(self, job: Path, wall_timeout: int) -> dict:
        """Run one prepared job; the worker's own failures become a status, never an exception."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        try:
            self.proc.stdin.write(f"{job}\n")
            self.proc.stdin.flush()
            line = self.lines.get(timeout=wall_timeout)
        except queue.Empty:
            self.stop()
            return {"status": "failed: timeout (whole notebook)", "failed_cell": None}
        except (BrokenPipeError, OSError):
            line = None
        if line is None:
            self.stop()
            return {"status": "failed: sandbox error (worker crashed)", "failed_cell": None}
        try:
            return json.loads((job / "result.json").read_text())
        except (OSError, ValueError):
            return {"status": "failed: sandbox error (no result)", "failed_cell": None}

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None


def apply_verdicts(nb, nonce: str, status: str, wanted: dict[str, list]) -> list[str]:
    """Zero test cells that were tampered with, not executed, or whose recorded hidden checks differ from the
    expected results `wanted` (grade_id -> records of the trusted run): an error output first. Strips the
    guard's marker lines; returns flags."""
    import nbformat
    flags = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        is_test = cell.metadata.get("nbgrader", {}).get("grade", False)
        verdicts, recorded, kept = [], [], []
        for out in cell.get("outputs", []):
            if out.output_type == "stream" and nonce in out.text:
                lines = out.text.split("\n")
                for ln in lines:
                    if ln.startswith(f"{nonce} check "):
                        try:
                            recorded.append(json.loads(ln[len(nonce) + 7:]))
                        except ValueError:
                            recorded.append({})
                    elif nonce in ln:
                        verdicts.append(ln.split(nonce, 1)[1].strip())
                out.text = "\n".join(ln for ln in lines if nonce not in ln)
                if not out.text.strip():
                    continue
            if is_test and out.output_type == "execute_result":
                continue  # tests here never give partial credit; a learner-made result must not fake one
            kept.append(out)
        cell.outputs = kept
        if not is_test:
            continue
        grade_id = cell.metadata["nbgrader"].get("grade_id", "?")
        why = None
        if cell.get("execution_count") is None:
            why = f"not run ({status})"
        elif not verdicts:
            why = "tampering: the grader's guard did not report (was it disabled?)"
        elif verdicts[-1].startswith("error: "):
            if not any(out.output_type == "error" for out in kept):
                why = f"tampering: the test failed ({verdicts[-1][7:]}) but its error was hidden"
        elif verdicts[-1] != "ok":
            why = "tampering: " + verdicts[-1].removeprefix("tamper: ")
        if why is None and not any(out.output_type == "error" for out in kept):
            if any(out.output_type == "stream" and sandbox.TRUNCATED in out.text for out in kept):
                why = (f"the test's output went over the grader's cap ({sandbox.OUTPUT_CAP:,} characters per cell), "
                       "so its hidden checks' records were cut off: print less (instructors: record smaller results)")
            else:
                why = expected.verdicts(wanted.get(grade_id, []), recorded)
        if why:
            if why.startswith("tampering"):
                flags.append(f"{grade_id}: {why}")
            cell.outputs.insert(0, nbformat.v4.new_output("error", ename="GraderError", evalue=why,
                                                          traceback=[f"GraderError: {why}"]))
    return flags


def finalize(student: str, assignment: str, job: Path, result: dict, nonce: str, wanted: dict) -> list[str]:
    """Executed notebook -> gradebook (nbgrader's own grading preprocessors) and autograded/ copy."""
    import nbformat
    from nbgrader.preprocessors import (AssignLatePenalties, CheckCellMetadata, IgnorePattern, LimitOutput,
                                        SaveAutoGrades)
    nb = nbformat.read(job / "executed.ipynb", as_version=4)
    flags = apply_verdicts(nb, nonce, result["status"], wanted)
    nb, _ = _run_preprocessors(nb, _resources(student, assignment),
                               [IgnorePattern, LimitOutput, SaveAutoGrades, AssignLatePenalties, CheckCellMetadata])
    dest = AUTOGRADED / student / assignment
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    nbformat.write(nb, dest / f"{assignment}.ipynb")
    stamp = SUBMITTED / student / assignment / "timestamp.txt"
    if stamp.exists():
        shutil.copy(stamp, dest / "timestamp.txt")
    return flags


def _progress(done, total, counts, running, t0, tty):
    rate = done / max(time.monotonic() - t0, 1e-9) * 60
    line = (f"[{done}/{total}] {counts['graded']} graded, {counts['failed']} failed, {counts['skipped']} unchanged"
            f" | {rate:.1f}/min | running: {', '.join(running) or '-'}")
    print(("\r" + line[:150].ljust(150)) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)


def autograde(jobs: int = 2, cell_timeout: int = 60, wall_timeout: int = 900, force: bool = False,
              only: list[str] | None = None, quiet: bool = False) -> dict:
    """Grade what changed; returns the state dict (also saved to autograder/grading_state.json)."""
    from nbgrader.api import Gradebook
    with Gradebook(DB_URL, COURSE_ID) as gb:
        known = set(chapters()) & {a.name for a in gb.assignments}
    chapter_prints = {a: expected.fingerprint(a) for a in known}
    state = load_state()
    todo, counts = [], {"graded": 0, "failed": 0, "skipped": 0}
    for student, assignment in submissions():
        key = f"{student}/{assignment}"
        if only and student not in only:
            continue
        if assignment not in known:
            state[key] = {"status": f"failed: unknown assignment {assignment} (not in the gradebook: make release?)",
                          "hash": None}
            counts["failed"] += 1
            continue
        digest = fingerprint(SUBMITTED / student / assignment, chapter_prints[assignment])
        if not force and state.get(key, {}).get("hash") == digest and not state[key]["status"].startswith(
                ("failed: sandbox error", "failed: grader error")):
            counts["skipped"] += 1
            continue
        todo.append((student, assignment, digest))
    needed = sorted({a for _, a, _ in todo})
    if needed and not quiet:
        print(f"expected results of {len(needed)} chapter(s): the hidden tests run on the solutions "
              "(only when a solution, a reference or the course changed)", file=sys.stderr)
    wanted = expected.load_all(needed, jobs)
    for student, assignment, digest in [t for t in todo if isinstance(wanted[t[1]], str)]:
        _record(state, student, assignment, digest, {"status": f"failed: grader error ({wanted[assignment]})"[:300]},
                [], counts)
    todo = [t for t in todo if not isinstance(wanted[t[1]], str)]
    warm_matplotlib()
    base = Path(tempfile.mkdtemp(prefix="mgpu-grading-"))
    tty = sys.stderr.isatty() and not quiet
    t0, done, total = time.monotonic(), 0, len(todo)
    free = [Slot(i, base) for i in range(jobs)]
    slots = list(free)
    running = {}
    finished = []  # (future, job info): post-processed after the slot has its next submission
    with ThreadPoolExecutor(jobs) as pool:
        pending = list(todo)
        while pending or running or finished:
            while pending and free:
                student, assignment, digest = pending.pop(0)
                slot = free.pop()
                job = base / "jobs" / f"{student}__{assignment}"
                t = time.monotonic()
                register(student, assignment)
                status, flags = prepare(student, assignment, job, slot, cell_timeout)
                if status:
                    free.append(slot)
                    _record(state, student, assignment, digest, {"status": status}, flags, counts)
                    done += 1
                    continue
                fut = pool.submit(slot.execute, job, wall_timeout)
                running[fut] = (student, assignment, digest, slot, job, flags, time.monotonic() - t)
            for fut, (student, assignment, digest, slot, job, flags, parent_seconds) in finished:
                t = time.monotonic()
                result = fut.result()
                nonce = json.loads((job / "job.json").read_text())["nonce"]
                if (job / "executed.ipynb").exists():
                    try:
                        flags = flags + finalize(student, assignment, job, result, nonce, wanted[assignment])
                    except Exception as e:
                        result["status"] = f"failed: sandbox error ({type(e).__name__}: {str(e)[:80]})"
                result["parent_seconds"] = round(parent_seconds + time.monotonic() - t, 2)
                _record(state, student, assignment, digest, result, flags, counts)
                if not os.environ.get("GRADER_DEBUG"):
                    shutil.rmtree(job, ignore_errors=True)
                done += 1
            if finished:
                finished = []
                save_state(state)
            if not quiet:
                _progress(done, total, counts, [f"{s}/{a}" for s, a, *_ in running.values()], t0, tty)
            if running:
                for fut in wait(running, return_when=FIRST_COMPLETED)[0]:
                    finished.append((fut, running.pop(fut)))
                    free.append(finished[-1][1][3])
    for slot in slots:
        slot.stop()
    if not quiet:
        _progress(done, total, counts, [], t0, tty)
        print(file=sys.stderr)
    if not os.environ.get("GRADER_DEBUG"):
        shutil.rmtree(base, ignore_errors=True)
    save_state(state)
    return state


def _record(state, student, assignment, digest, result, flags, counts):
    status = result["status"]
    if status.startswith("failed") and result.get("failed_cell") is not None:
        status += f" (cell {result['failed_cell']})"
    state[f"{student}/{assignment}"] = {
        "hash": digest, "status": status, "flags": flags, "seconds": result.get("seconds"),
        "kernel_start_seconds": result.get("kernel_start_seconds"), "parent_seconds": result.get("parent_seconds"),
        "zygote_start_seconds": result.get("zygote_start_seconds"), "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    counts["failed" if status.startswith("failed") else "graded"] += 1
