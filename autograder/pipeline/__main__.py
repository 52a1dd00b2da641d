"""`python -m autograder.pipeline <command>`: release | collect ZIP | autograde | feedback | grades | check | selfcheck."""
import argparse
import os
import sys
import warnings

from . import sandbox


def main(argv=None) -> int:
    # nbgrader's gradebook runs the `alembic` command it installed: find it however we were started.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    # nbgrader's own SQLAlchemy and deprecation warnings: nothing an instructor can act on.
    warnings.filterwarnings("ignore", module=r"nbgrader\.")
    p = argparse.ArgumentParser(prog="python -m autograder.pipeline", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("release", help="student notebooks in notebooks/ and a zip to upload to an LMS")
    c = sub.add_parser("collect", help="unpack an LMS export into autograder/submitted/")
    c.add_argument("zip")
    a = sub.add_parser("autograde", help="grade every new or changed submission, sandboxed, in parallel")
    a.add_argument("--jobs", type=int, default=2)
    a.add_argument("--cell-timeout", type=int, default=60, help="seconds per cell (default 60)")
    a.add_argument("--force", action="store_true", help="regrade unchanged submissions too")
    a.add_argument("--student", action="append", help="only this student (repeatable)")
    a.add_argument("--no-sandbox", action="store_true",
                   help="UNSAFE: run learner code without the sandbox (only resource limits)")
    sub.add_parser("feedback", help="feedback HTML per student, hidden tests removed")
    sub.add_parser("grades", help="autograder/grades.csv with a status column")
    sub.add_parser("check", help="say whether the sandbox works here")
    s = sub.add_parser("selfcheck", help="a chapter's hidden tests pass on its solution and record what they expect")
    s.add_argument("chapter", nargs="*")
    s.add_argument("--notebook", help="run this copy of the chapter's solution (with a wrong answer, say) instead")
    args = p.parse_args(argv)

    if args.cmd == "check" or args.cmd == "autograde":
        if getattr(args, "no_sandbox", False):
            os.environ["GRADER_NO_SANDBOX"] = "1"
            print("WARNING: grading WITHOUT the sandbox: learner code can read the gradebook, the references,\n"
                  "the expected results and other submissions, use the network and write anywhere you can.",
                  file=sys.stderr)
        why = None if getattr(args, "no_sandbox", False) else sandbox.problem()
        if args.cmd == "check":
            print(f"sandbox unavailable: {why}" if why else "sandbox OK")
            return 1 if why else 0
        if why:
            print(f"make autograde refuses: the sandbox cannot be set up here ({why}).\n"
                  "Install bubblewrap (apt-get install bubblewrap; util-linux gives prlimit/setpriv).\n"
                  "Without it learner code runs with your permissions, next to the gradebook and the\n"
                  "reference answers. To grade anyway (trusted submissions only): make autograde UNSAFE_NO_SANDBOX=1",
                  file=sys.stderr)
            return 2
        from .autograde import autograde
        state = autograde(jobs=args.jobs, cell_timeout=args.cell_timeout, force=args.force, only=args.student)
        failed = sorted(k for k, v in state.items() if v["status"].startswith("failed"))
        for k in failed:
            print(f"  {k}: {state[k]['status']}", file=sys.stderr)
        return 0
    if args.cmd == "release":
        from .release import release
        return release()
    if args.cmd == "collect":
        from .collect import collect
        return collect(args.zip)
    if args.cmd == "feedback":
        from .feedback import feedback
        return feedback()
    if args.cmd == "selfcheck":
        from . import chapters
        from .expected import selfcheck
        from pathlib import Path
        if args.notebook and len(args.chapter) != 1:
            p.error("--notebook needs exactly one chapter")
        return selfcheck(args.chapter or chapters(), Path(args.notebook).resolve() if args.notebook else None)
    if args.cmd == "grades":
        from .grades import grades
        return grades()
    return 1


if __name__ == "__main__":
    sys.exit(main())
