"""`make autograde` without a usable sandbox: it refuses and says why, unless the instructor opts out."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pipeline(tmp_path, *args):
    """The real command line, on a PATH without bwrap, prlimit or setpriv, grading a throw-away course."""
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"), GRADER_COURSE_DIR=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "autograder.pipeline", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_autograde_refuses_without_the_sandbox_and_says_what_to_do(tmp_path):
    r = _pipeline(tmp_path, "autograde")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "make autograde refuses: the sandbox cannot be set up here (missing bwrap (Debian package bubblewrap)" in r.stderr
    assert "apt-get install bubblewrap" in r.stderr and "UNSAFE_NO_SANDBOX=1" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "autograder").exists(), "nothing may be graded or written"


def test_check_says_the_sandbox_is_unavailable(tmp_path):
    r = _pipeline(tmp_path, "check")
    assert r.returncode == 1 and r.stdout.startswith("sandbox unavailable: missing bwrap"), r.stdout + r.stderr
