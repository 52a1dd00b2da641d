"""Grade a synthetic class with the sandboxed pipeline and print notebooks/minute and where the time goes.

    .venv/bin/python benchmarks/autograde.py [--students 30] [--chapters 01_devices_and_transfers ...] [--jobs 2]

A class of N students x every chapter (a throw-away course folder, the real gradebook is untouched): 40%
correct, 30% partly wrong (one answer left as the stub), 30% broken (untouched stubs, or corrupt JSON).
Target (issue #6): 30 students x 9 chapters in under 20 minutes on the 2-core course machine.
"""
import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from autograder.pipeline import synthetic  # noqa: E402


def build(course: Path, chapters: list[str], students: int) -> dict:
    kinds = {}
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    shutil.copy(ROOT / "nbgrader_config.py", course)
    shutil.copytree(ROOT / "autograder" / "references", course / "autograder" / "references")
    for ch in chapters:
        shutil.copytree(ROOT / "solutions" / ch, course / "solutions" / ch)
    subprocess.run([sys.executable, "-m", "autograder.pipeline", "release"], cwd=ROOT, check=True,
                   env=dict(env, GRADER_COURSE_DIR=str(course)), stderr=subprocess.DEVNULL)
    for ch in chapters:
        student = json.loads((course / "notebooks" / ch / f"{ch}.ipynb").read_text())
        solution = synthetic.solution_answers(json.loads((ROOT / "solutions" / ch / f"{ch}.ipynb").read_text()))
        for i in range(students):
            kind = ["correct", "correct", "correct", "correct", "partly wrong", "partly wrong", "partly wrong",
                    "untouched", "untouched", "corrupt"][i % 10]
            answers = dict(solution) if kind in ("correct", "partly wrong") else {}
            if kind == "partly wrong":  # one answer left as the stub
                answers.pop(sorted(solution)[i % len(solution)])
            nb = synthetic.answered(student, answers)
            folder = course / "autograder" / "submitted" / f"s{i:03d}" / ch
            folder.mkdir(parents=True)
            text = json.dumps(nb) if kind != "corrupt" else json.dumps(nb)[: len(json.dumps(nb)) // 2]
            (folder / f"{ch}.ipynb").write_text(text)
            kinds[f"s{i:03d}/{ch}"] = kind
    return kinds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--students", type=int, default=30)
    p.add_argument("--chapters", nargs="*")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args()
    chapters = args.chapters or sorted(d.name for d in (ROOT / "solutions").iterdir() if (d / f"{d.name}.ipynb").exists())
    course = Path(tempfile.mkdtemp(prefix="mgpu-bench-"))
    try:
        kinds = build(course, chapters, args.students)
        env = dict(os.environ, GRADER_COURSE_DIR=str(course),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        t0 = time.monotonic()  # the trusted run first, on its own, to see its share (autograde would do it)
        subprocess.run([sys.executable, "-c", "import sys; from autograder.pipeline import expected; "
                        f"sys.exit(any(isinstance(v, str) for v in expected.load_all({chapters!r}, {args.jobs}).values()))"],
                       cwd=ROOT, env=env, check=True)
        trusted = time.monotonic() - t0
        subprocess.run([sys.executable, "-m", "autograder.pipeline", "autograde", "--jobs", str(args.jobs)],
                       cwd=ROOT, env=env, check=True)
        total = time.monotonic() - t0
        state = json.loads((course / "autograder" / "grading_state.json").read_text())
        subprocess.run([sys.executable, "-m", "autograder.pipeline", "grades"], cwd=ROOT, env=env, check=True)
        with open(course / "autograder" / "grades.csv") as f:
            grades = {f"{r['student']}/{r['assignment']}": r for r in csv.DictReader(f)}
    finally:
        shutil.rmtree(course, ignore_errors=True)
    n = len(kinds)
    print(f"\n{n} notebooks ({args.students} students x {len(chapters)} chapters), {args.jobs} workers, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"total {total / 60:.1f} min, {n / total * 60:.1f} notebooks/minute; of which {trusted:.0f} s for the "
          f"expected results (the hidden tests run once on each chapter's solution, {args.jobs} at a time)")
    ran = [v for v in state.values() if v.get("seconds")]
    if ran:
        start = statistics.mean(v["kernel_start_seconds"] for v in ran)
        run = statistics.mean(v["seconds"] for v in ran)
        parent = statistics.mean(v.get("parent_seconds") or 0 for v in ran)
        print(f"per executed notebook (mean of {len(ran)}): {run:.1f} s in the worker, of which kernel start "
              f"(fork from the zygote + guard) {start:.1f} s, cell execution {run - start:.1f} s; "
              f"{parent:.1f} s of nbgrader pre/post-processing in the parent (overlaps the next notebook)")
    zygotes = [v["zygote_start_seconds"] for v in state.values() if v.get("zygote_start_seconds")]
    if zygotes:
        print(f"zygote starts (sandbox + python + ipykernel, torch, matplotlib, course imported + warm-up): "
              f"{len(zygotes)}, mean {statistics.mean(zygotes):.1f} s")
    for kind in sorted(set(kinds.values())):
        secs = [state[k].get("seconds") or 0 for k, v in kinds.items() if v == kind and k in state]
        statuses = sorted({state[k]["status"].split(" (")[0] for k, v in kinds.items() if v == kind and k in state})
        print(f"  {kind:13} {len(secs):4} notebooks, mean {statistics.mean(secs):5.1f} s, status {statuses}, "
              f"scores {_scores([grades[k] for k, v in kinds.items() if v == kind])}")


def _scores(rows) -> str:
    """How many got full marks, zero, something between, or no score (could not be graded)."""
    def bucket(r):
        if not r["score"]:
            return "none"
        score, best = float(r["score"]), float(r["max_score"])
        return "full" if score == best else "zero" if score == 0 else "partial"
    counts = {b: sum(bucket(r) == b for r in rows) for b in ("full", "partial", "zero", "none")}
    return ", ".join(f"{n} {b}" for b, n in counts.items() if n)


if __name__ == "__main__":
    main()
