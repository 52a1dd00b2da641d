"""Unpack an LMS export (a zip of notebooks) into autograder/submitted/<student>/<assignment>/.

Does what nbgrader's zip_collect + FileNameCollectorPlugin do (a regex with named groups student_id,
file_id, assignment over each archive member), minus its extract-to-disk step, plus reporting every
member it cannot place. File names must match the pattern below (override with COLLECT_PATTERN): `<student>_<assignment>.ipynb` or `<student>/<assignment>.ipynb`,
optionally with an LMS prefix. Anything that does not match, or names an unknown assignment, is reported.
Each member's time in the archive becomes the submission's timestamp.txt (what nbgrader reads for lateness).
When a learner handed in one assignment several times, the latest copy is kept and the others are reported.
"""
import os
import re
import sys
import zipfile
from pathlib import Path

from . import SUBMITTED, chapters

DEFAULT = r".*?(?P<student_id>[A-Za-z0-9][\w.@-]*?)[_/](?P<file_id>(?P<assignment>\d\d_[a-z0-9_]+)\.ipynb)$"


def collect(zip_path: str) -> int:
    pattern = re.compile(os.environ.get("COLLECT_PATTERN") or DEFAULT)
    known, problems, ok = set(chapters()), [], 0
    try:
        archive = zipfile.ZipFile(zip_path)
    except (OSError, zipfile.BadZipFile) as e:
        print(f"cannot read {zip_path}: {e}", file=sys.stderr)
        return 2
    latest = {}  # (student, assignment) -> the member kept
    with archive:
        for info in archive.infolist():
            name = info.filename
            if info.is_dir() or "__MACOSX" in name or Path(name).name.startswith("."):
                continue
            m = pattern.match(name)
            if not m:
                problems.append(f"{name}: file name not understood (expected <student>_<assignment>.ipynb)")
                continue
            student, assignment = m.group("student_id"), m.group("assignment")
            if assignment not in known:
                problems.append(f"{name}: unknown assignment {assignment!r}")
                continue
            if ".." in Path(student).parts or "/" in student:
                problems.append(f"{name}: bad student id")
                continue
            key = (student, assignment)
            if key in latest:
                older, info = sorted((latest[key], info), key=lambda i: i.date_time)
                problems.append(f"{older.filename}: {student} handed in {assignment} again later "
                                f"({info.filename}, which is kept)")
            latest[key] = info
        for (student, assignment), info in latest.items():
            dest = SUBMITTED / student / assignment / f"{assignment}.ipynb"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(archive.read(info))
            # The member's time is when the LMS received it: nbgrader's late penalties read timestamp.txt.
            (dest.parent / "timestamp.txt").write_text("{:04d}-{:02d}-{:02d} {:02d}:{:02d}:{:02d}".format(*info.date_time))
            ok += 1
    for p in problems:
        print("  " + p, file=sys.stderr)
    print(f"collected {ok} notebooks into {SUBMITTED}/, {len(problems)} problems", file=sys.stderr)
    return 1 if problems and not ok else 0
