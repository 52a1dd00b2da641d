"""`make release`: regenerate the student notebooks and zip them for an LMS (autograder/release.zip)."""
import sys
import zipfile

from . import AUTOGRADER, COURSE, chapters, nbgrader_api


def release() -> int:
    api = nbgrader_api()
    for a in chapters():
        result = api.generate_assignment(a, force=True)
        if not result["success"]:
            print(f"{a}: {result.get('error') or result.get('log', '')[-2000:]}", file=sys.stderr)
            return 1
    out = AUTOGRADER / "release.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for a in chapters():
            z.write(COURSE / "notebooks" / a / f"{a}.ipynb", f"{a}/{a}.ipynb")
        if (COURSE / "notebooks" / "README.md").exists():
            z.write(COURSE / "notebooks" / "README.md", "README.md")
    print(f"student notebooks: notebooks/<chapter>/; for an LMS upload: {out}", file=sys.stderr)
    return 0
