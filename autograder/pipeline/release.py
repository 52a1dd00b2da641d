"""`make release`: regenerate the student notebooks and zip them for an LMS (autograder/release.zip)."""
import subprocess
import sys
import zipfile

from . import AUTOGRADER, ROOT, chapters


def release() -> int:
    for a in chapters():
        r = subprocess.run([sys.executable, "-m", "nbgrader", "generate_assignment", a, "--force",
                            "--log-level=WARN"], cwd=ROOT)
        if r.returncode:
            return r.returncode
    out = AUTOGRADER / "release.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for a in chapters():
            z.write(ROOT / "notebooks" / a / f"{a}.ipynb", f"{a}/{a}.ipynb")
        z.write(ROOT / "notebooks" / "README.md", "README.md")
    print(f"student notebooks: notebooks/<chapter>/; for an LMS upload: {out.relative_to(ROOT)}", file=sys.stderr)
    return 0
