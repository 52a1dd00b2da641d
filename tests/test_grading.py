"""The instructor's grading pipeline on a corpus of good and bad submissions built from the real chapter 01.

One class of ~20 submissions is graded once (module fixture, sandboxed, 2 at a time, a few minutes) in a
throw-away course folder (GRADER_COURSE_DIR), so the real gradebook is never touched; each test then reads
autograder/grades.csv, the grading state, the autograded notebooks and the feedback.
"""
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CH = "01_devices_and_transfers"
FULL = 15.0

sys.path.insert(0, str(ROOT))
from autograder.pipeline import synthetic  # noqa: E402

pytestmark = pytest.mark.needs("sandbox")  # fails without it unless ALLOW_SKIP=1 (tests/conftest.py)


def _cells(nb, kind="solution"):
    return {c["metadata"]["nbgrader"]["grade_id"]: c for c in nb["cells"]
            if c["metadata"].get("nbgrader", {}).get(kind)}


WRONG = {  # wrong answers, the baseline every cheat is compared with
    "move_batch": "def move_batch(batch, device):\n    return {k: (t + 1).pin_memory().to(device, non_blocking=True) for k, t in batch.items()}\n",
    "effective_bandwidth_gbps": "def effective_bandwidth_gbps(nbytes, ms):\n    return nbytes / ms\n",
    "predict_pinned_copy_ms": "predicted_ms = 1.5\n",
}
# Right values, wrong "how": every batch is pinned on the host first (a host copy of the whole batch), and the
# pageable ones then go without the host waiting. Hidden tests read that from the emulator, which lives in the
# learner's process: the cheats below patch the instrument itself.
UNPINNED = ("def move_batch(batch, device):\n"
            "    return {k: t.pin_memory().to(device, non_blocking=True) for k, t in batch.items()}\n")
FAKE_PINNING = "import course.cuda.transfers as T\nT.is_pinned = lambda tensor: True\n"
PATCH_ALL = ("import builtins, numpy, numpy.testing, torch, torch.testing\n"
             "torch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"
             "torch.testing.assert_close = lambda *a, **k: None\nnumpy.testing.assert_allclose = lambda *a, **k: None\n"
             "builtins.abs = lambda x: 0\nbuiltins.all = lambda x: True\n")
LIAR = ("class Liar(float):\n    def __eq__(s, o): return True\n    __le__ = __lt__ = __ge__ = __gt__ = __eq__\n"
        "    def __ne__(s, o): return False\n    def __sub__(s, o): return s\n    __rsub__ = __sub__\n"
        "    def __abs__(s): return s\n    def __hash__(s): return 0\n")
# Code written against the in-kernel guard (it shares the learner's process): the nonce read out of the
# guard's closures, the guard's post-run callback replaced by one that always reports "ok", every error hidden.
# Before hidden tests were judged outside the kernel this scored full marks with wrong answers.
GUARD_ATTACK = """
import gc
ip = get_ipython()
guard = [f for f in ip.events.callbacks["post_run_cell"] if f.__name__ == "post_run_cell"][0]
nonce = next(c.cell_contents for c in guard.__closure__
             if isinstance(c.cell_contents, str) and c.cell_contents.startswith("GRADER-"))
ip.events.unregister("post_run_cell", guard)
ip.events.register("post_run_cell", lambda result: print(f"\\n{nonce} ok"))
ip.set_custom_exc((BaseException,), lambda self, etype, value, tb, tb_offset=None: None)
"""
# Looks through every string reachable from the kernel's containers, closures and code objects for the
# references' sources or an expected result; the guard's nonce (also in a closure) is the positive control.
MEMORY_SEARCH = """
import gc, warnings
needles = tuple(a + b for a, b in (("hidden from ", "learners"), ("Reference ", "answers"), ('"wa', 'nt"'), ("GRA", "DER-")))
def strings(o):
    if isinstance(o, dict):
        return [v for v in o.values() if isinstance(v, str)]
    if isinstance(o, (list, tuple, set, frozenset)):
        return [v for v in o if isinstance(v, str)]
    if type(o).__name__ == "cell":
        try:
            return [o.cell_contents] if isinstance(o.cell_contents, str) else []
        except ValueError:
            return []
    if type(o).__name__ == "function":
        return [v for v in o.__code__.co_consts if isinstance(v, str)]
    return []
with warnings.catch_warnings():  # some module attributes warn when read
    warnings.simplefilter("ignore")
    found = {n for o in gc.get_objects() if o is not needles for s in strings(o) if s not in needles for n in needles if n in s}
print("MEMORY SEARCH FOUND", sorted(found))
"""


def _submission(student_nb, solution_nb, answers=None, extra=None, drop=(), edit=None):
    solved = synthetic.solution_answers(solution_nb)
    solved.update(answers or {})
    nb = synthetic.answered(student_nb, {gid: src + (extra or {}).get(gid, "") for gid, src in solved.items()})
    nb["cells"] = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") not in drop]
    for gid, src in (edit or {}).items():
        _cells(nb, "grade")[gid]["source"] = src
    return nb


def _corpus(student_nb, solution_nb, port):
    S = lambda **kw: _submission(student_nb, solution_nb, **kw)  # noqa: E731
    probe = f"""
import os, socket
def attempt(name, fn):
    try:
        fn(); print("ALLOWED", name)
    except Exception as e:
        print("BLOCKED", name, type(e).__name__)
attempt("gradebook", lambda: open({str(COURSE_DIR[0] / 'autograder' / 'gradebook.db')!r}, 'rb').read(1))
attempt("references file", lambda: open({str(COURSE_DIR[0] / 'autograder' / 'references' / 'devices_and_transfers.py')!r}).read())
attempt("repo references", lambda: open({str(ROOT / 'autograder' / 'references' / 'devices_and_transfers.py')!r}).read())
attempt("solutions", lambda: os.listdir({str(COURSE_DIR[0] / 'solutions')!r}))
attempt("repo git", lambda: os.listdir({str(ROOT / '.git')!r}))
attempt("import references", lambda: __import__("references.devices_and_transfers"))
attempt("write repo", lambda: open({str(ROOT / 'PWNED')!r}, 'w').write('x'))
attempt("write course", lambda: open({str(COURSE_DIR[0] / 'PWNED')!r}, 'w').write('x'))
attempt("network", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2))
attempt("dns", lambda: socket.getaddrinfo("pypi.org", 443))
"""
    return {
        "correct": S(),
        "untouched": student_nb,
        "partly_wrong": S(answers={"effective_bandwidth_gbps": WRONG["effective_bandwidth_gbps"]}),
        # a cell that never ends; it sleeps rather than spins, so that the 30 s it waits for its timeout leave the
        # CPU to the tests running beside it
        "infinite_loop": S(extra={"distributed_model_forward": "\nimport time\nwhile True:\n    time.sleep(0.5)\n"}),
        "os_exit": S(extra={"move_batch": "\nimport os\nos._exit(1)\n"}),
        "segfault": S(extra={"effective_bandwidth_gbps": "\nimport ctypes\nctypes.string_at(0)\n"}),
        # hits the sandbox's memory limit and fails with MemoryError, but gives the memory back first: the later
        # exercises (chapter 1's fast_train) need it, as they would after such a cell on any machine
        "memory_bomb": S(extra={"distributed_model_forward": (
            "\nblob = []\ntry:\n    while True:\n        blob.append(bytearray(2**28))\nexcept MemoryError:\n"
            "    blob.clear()\n    raise\n")}),
        "spawner": S(extra={"distributed_model_forward": (
            "\nimport os, time\nforked = 0\ntry:\n    for _ in range(100000):\n        if os.fork() == 0:\n"
            "            time.sleep(20)\n            os._exit(0)\n        forked += 1\nexcept OSError as e:\n"
            "    print('spawner stopped after', forked, type(e).__name__)\n")}),
        "big_output": S(extra={"effective_bandwidth_gbps": "\nfor _ in range(100):\n    print('x' * 10**6)\n"}),
        "loud_answer": S(answers={"effective_bandwidth_gbps": (
            "def effective_bandwidth_gbps(nbytes, ms):\n    if not getattr(effective_bandwidth_gbps, 'said', False):\n"
            "        print('x' * 1_500_000)\n        effective_bandwidth_gbps.said = True\n"
            "    return nbytes / ms / 1e6\n")}),  # prints once, over the cap
        "deleted_test": S(drop=("move_batch_tests",)),
        "edited_test": S(answers={"effective_bandwidth_gbps": WRONG["effective_bandwidth_gbps"]},
                         edit={"effective_bandwidth_gbps_tests": "pass\n"}),
        "wrong": S(answers=WRONG),
        "cheat_patch_toplevel": S(answers=WRONG, extra={"time_on_gpu": "\n" + PATCH_ALL}),
        "cheat_patch_in_function": S(answers={**WRONG, "effective_bandwidth_gbps": (
            "def effective_bandwidth_gbps(nbytes, ms):\n    import builtins, torch\n"
            "    builtins.abs = lambda x: 0\n    torch.allclose = lambda *a, **k: True\n    return nbytes / ms\n")}),
        "cheat_eq": S(answers={**WRONG, "predict_pinned_copy_ms": LIAR + "predicted_ms = Liar(1.5)\n",
                               "effective_bandwidth_gbps": LIAR + "def effective_bandwidth_gbps(nbytes, ms):\n    return Liar(0)\n"}),
        "cheat_references": S(answers={**WRONG, "effective_bandwidth_gbps": (
            "def effective_bandwidth_gbps(nbytes, ms):\n    from references.devices_and_transfers import "
            "effective_bandwidth_gbps as ref\n    return ref(nbytes, ms)\n")},
            extra={"time_on_gpu": "\ntry:\n    import references\nexcept ImportError:\n    pass\n"}),
        "cheat_hidden_error": S(answers=WRONG, extra={"time_on_gpu": (
            "\nget_ipython().set_custom_exc((BaseException,), lambda self, etype, value, tb, tb_offset=None: None)\n")}),
        "cheat_showtraceback": S(answers=WRONG, extra={"time_on_gpu": "\nget_ipython().showtraceback = lambda *a, **k: None\n"}),
        "snoop": S(extra={"time_on_gpu": probe}),
        "hidden_only_wrong": S(answers={"effective_bandwidth_gbps": (  # right on the visible asserts only
            "def effective_bandwidth_gbps(nbytes, ms):\n    return round(nbytes / ms / 1e6, 3)\n")}),
        "cheat_guard_attack": S(answers=WRONG, extra={"time_on_gpu": GUARD_ATTACK}),
        "wrong_how": S(answers={**WRONG, "move_batch": UNPINNED}),
        "cheat_instrument_toplevel": S(answers={**WRONG, "move_batch": UNPINNED}, extra={"time_on_gpu": "\n" + FAKE_PINNING}),
        "cheat_instrument_code": S(answers={**WRONG, "move_batch": UNPINNED}, extra={"time_on_gpu": (
            "\nimport course.cuda.transfers\ncourse.transfers.is_pinned.__code__ = (lambda tensor: True).__code__\n")}),
        "cheat_instrument_in_function": S(answers={**WRONG, "move_batch": (
            "def move_batch(batch, device):\n    " + FAKE_PINNING.replace("\n", "\n    ")
            + "return {k: t.pin_memory().to(device, non_blocking=True) for k, t in batch.items()}\n")}),
        "memory_search": S(extra={"time_on_gpu": MEMORY_SEARCH}),
    }


COURSE_DIR = []


@pytest.fixture(scope="module")
def graded(tmp_path_factory, expected_results):
    course = tmp_path_factory.mktemp("course")
    COURSE_DIR.append(course)
    for rel in (f"solutions/{CH}", "autograder/references"):
        shutil.copytree(ROOT / rel, course / rel)
    (course / "autograder" / "expected").symlink_to(expected_results)  # shared, see tests/conftest.py
    shutil.copy(ROOT / "nbgrader_config.py", course)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               GRADER_COURSE_DIR=str(course))
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", CH, "--force", "--log-level=ERROR"],
                   cwd=course, env=env, check=True, timeout=300)
    student_nb = json.loads((course / "notebooks" / CH / f"{CH}.ipynb").read_text())
    solution_nb = json.loads((ROOT / "solutions" / CH / f"{CH}.ipynb").read_text())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    threading.Thread(target=lambda: [listener.accept() for _ in range(5)], daemon=True).start()
    sub = course / "autograder" / "submitted"
    for name, nb in _corpus(student_nb, solution_nb, listener.getsockname()[1]).items():
        (sub / name / CH).mkdir(parents=True)
        (sub / name / CH / f"{CH}.ipynb").write_text(json.dumps(nb))
    (sub / "corrupt" / CH).mkdir(parents=True)
    (sub / "corrupt" / CH / f"{CH}.ipynb").write_text('{"cells": [ {"cell_type": "code", ')
    (sub / "missing" / CH).mkdir(parents=True)
    (sub / "misnamed" / CH).mkdir(parents=True)
    (sub / "misnamed" / CH / "01_devices.ipynb").write_text(json.dumps(student_nb))

    def pipeline(*args, timeout=1200):
        r = subprocess.run([sys.executable, "-m", "autograder.pipeline", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout + r.stderr

    log = pipeline("autograde", "--cell-timeout", "30")
    pipeline("grades")
    pipeline("feedback", timeout=600)
    rows = {r["student"]: r for r in csv.DictReader(open(course / "autograder" / "grades.csv"))}
    yield {"course": course, "rows": rows, "log": log, "pipeline": pipeline,
           "state": json.loads((course / "autograder" / "grading_state.json").read_text())}
    listener.close()


def score(graded, student):
    return float(graded["rows"][student]["score"])


def test_table(graded):
    """Prints the corpus -> status/score table (pytest -s shows it)."""
    for name, row in sorted(graded["rows"].items()):
        print(f"{name:25} {row['score']:>5} / {row['max_score']:<5} {row['status']:45} {row['flags']}")


@pytest.mark.parametrize("student", ["correct", "memory_bomb", "spawner", "big_output", "deleted_test", "snoop",
                                     "memory_search"])
def test_correct_answers_get_full_marks_whatever_else_the_notebook_does(graded, student):
    assert graded["rows"][student]["status"] == "graded", graded["rows"][student]
    assert score(graded, student) == FULL


def test_untouched_and_partly_wrong(graded):
    assert graded["rows"]["untouched"]["status"] == "graded" and score(graded, "untouched") == 0
    assert graded["rows"]["partly_wrong"]["status"] == "graded" and score(graded, "partly_wrong") == FULL - 1


@pytest.mark.parametrize("student,status", [("infinite_loop", "failed: timeout"), ("os_exit", "failed: kernel died"),
                                            ("segfault", "failed: kernel died"),
                                            ("corrupt", "failed: corrupt notebook"),
                                            ("missing", "failed: missing notebook"),
                                            ("misnamed", "failed: misnamed notebook")])
def test_failures_are_reported_not_zeroed(graded, student, status):
    row = graded["rows"][student]
    assert row["status"].startswith(status), row
    if student in ("corrupt", "missing", "misnamed"):
        assert row["score"] == ""
    else:  # tests that ran before the failure keep their points; the rest are 0, never free points
        assert 0 < score(graded, student) < FULL


def test_hidden_checks_are_judged_outside_the_kernel(graded):
    """Right on the visible asserts, wrong on the hidden inputs: only the comparison outside the kernel sees it."""
    assert score(graded, "hidden_only_wrong") == FULL - 1
    nb = json.loads((graded["course"] / "autograder" / "autograded" / "hidden_only_wrong" / CH / f"{CH}.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "effective_bandwidth_gbps_tests")
    assert "the result differs from the reference" in cell["outputs"][0]["evalue"], cell["outputs"]


def test_an_attack_on_the_guard_is_caught_outside_the_kernel(graded):
    """The attack beat the guard (no error shows, no tampering is flagged); the outside comparison still
    zeroes every wrong answer, because a failed assert leaves its hidden checks unrecorded."""
    nb = json.loads((graded["course"] / "autograder" / "autograded" / "cheat_guard_attack" / CH / f"{CH}.ipynb").read_text())
    errors = [o for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("grade") for o in c["outputs"]
              if o["output_type"] == "error"]
    assert errors and all(o["ename"] == "GraderError" and o["evalue"].startswith("hidden check") for o in errors), errors
    assert "tampering" not in graded["rows"]["cheat_guard_attack"]["flags"]


def test_neither_references_nor_expected_results_are_in_the_kernel(graded):
    nb = json.loads((graded["course"] / "autograder" / "autograded" / "memory_search" / CH / f"{CH}.ipynb").read_text())
    assert "MEMORY SEARCH FOUND ['GRADER-']" in json.dumps(nb), json.dumps(nb)[:3000]


def test_edited_test_cell_is_restored(graded):
    assert score(graded, "edited_test") == FULL - 1


@pytest.mark.parametrize("cheat", ["cheat_patch_toplevel", "cheat_patch_in_function", "cheat_eq", "cheat_references",
                                   "cheat_hidden_error", "cheat_showtraceback", "cheat_guard_attack"])
def test_a_cheat_never_scores_more_than_the_same_wrong_answers(graded, cheat):
    assert graded["rows"][cheat]["status"] == "graded"
    assert score(graded, cheat) <= score(graded, "wrong") < FULL


@pytest.mark.parametrize("cheat", ["cheat_instrument_toplevel", "cheat_instrument_code", "cheat_instrument_in_function"])
def test_patching_the_emulator_does_not_turn_a_wrong_how_into_points(graded, cheat):
    """The values are right, the copies are not pinned; patching the emulator to say they are gains nothing."""
    assert graded["rows"][cheat]["status"] == "graded"
    assert score(graded, cheat) <= score(graded, "wrong_how") < FULL
    assert "review: " in graded["rows"][cheat]["flags"], graded["rows"][cheat]


def test_tampering_during_a_test_is_flagged(graded):
    assert "tampering" in graded["rows"]["cheat_patch_in_function"]["flags"]
    assert "course.cuda.transfers.is_pinned replaced" in graded["rows"]["cheat_instrument_in_function"]["flags"]
    assert "review" in graded["rows"]["cheat_references"]["flags"]
    for cheat in ("cheat_hidden_error", "cheat_showtraceback"):  # failed tests whose error output was suppressed
        assert "its error was hidden" in graded["rows"][cheat]["flags"], graded["rows"][cheat]


def test_sandbox_blocks_reads_writes_and_network(graded):
    nb = json.loads((graded["course"] / "autograder" / "autograded" / "snoop" / CH / f"{CH}.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"])
    assert text.count("BLOCKED") == 10 and "ALLOWED" not in text, text
    assert not (ROOT / "PWNED").exists() and not (graded["course"] / "PWNED").exists()


def test_a_test_whose_output_goes_over_the_cap_says_so_and_is_not_called_tampering(graded):
    row = graded["rows"]["loud_answer"]
    assert row["status"] == "graded" and row["flags"] == "", row
    assert score(graded, "loud_answer") == FULL - 1  # effective_bandwidth_gbps_tests is worth 1 point
    nb = json.loads((graded["course"] / "autograder" / "autograded" / "loud_answer" / CH / f"{CH}.ipynb").read_text())
    assert "went over the grader's cap" in json.dumps(nb)


def test_resource_limits_stopped_the_bombs(graded):
    nb = json.loads((graded["course"] / "autograder" / "autograded" / "spawner" / CH / f"{CH}.ipynb").read_text())
    assert "spawner stopped after" in json.dumps(nb)
    big = graded["course"] / "autograder" / "autograded" / "big_output" / CH / f"{CH}.ipynb"
    assert big.stat().st_size < 5_000_000


def test_feedback_shows_results_but_not_hidden_tests(graded):
    files = list((graded["course"] / "autograder" / "feedback").rglob("*.html"))
    assert len(files) >= 10
    for f in files:
        html = f.read_text()
        assert "HIDDEN TESTS" not in html and "from grading import" not in html and "rng = random.Random" not in html, f


def test_rerun_skips_unchanged_and_keeps_manual_grades(graded):
    from nbgrader.api import Gradebook
    db = "sqlite:///" + str(graded["course"] / "autograder" / "gradebook.db")
    with Gradebook(db, "multigpu-course") as gb:
        grade = gb.find_grade("effective_bandwidth_gbps_tests", CH, CH, "partly_wrong")
        grade.manual_score = 1.0
        gb.db.commit()
    log = graded["pipeline"]("autograde", "--student", "partly_wrong", "--student", "correct")
    assert "0 graded, 0 failed, 2 unchanged" in log, log
    graded["pipeline"]("autograde", "--force", "--student", "partly_wrong")
    graded["pipeline"]("grades")
    rows = {r["student"]: r for r in csv.DictReader(open(graded["course"] / "autograder" / "grades.csv"))}
    assert float(rows["partly_wrong"]["score"]) == FULL
