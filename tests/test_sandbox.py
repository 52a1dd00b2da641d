"""One grading slot, two submissions in a row, through the real sandbox and zygote: the second finds nothing
the first left behind, neither can reach the zygote that forked it, and the disk they may fill is /tmp's."""
import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from autograder.pipeline import sandbox  # noqa: E402

pytestmark = pytest.mark.needs("sandbox")  # fails without it unless ALLOW_SKIP=1 (tests/conftest.py)

LEAVE = """
import ctypes, os, subprocess
subprocess.Popen(["sleep", "300"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    os.execvp("sleep", ["sleep", "301"])
open("/tmp/note-for-the-next-one", "w").write("answers")
open("note-in-my-folder", "w").write("answers")
libc = ctypes.CDLL(None)
shm = libc.shmget(4242, 4096, 0o1600)
print("left", shm >= 0)
"""
LOOK = """
import ctypes, os
mine = {os.getpid(), 1, os.getppid()}
print("processes", sorted(open(f"/proc/{p}/cmdline").read().replace("\\0", " ").strip()
                          for p in os.listdir("/proc") if p.isdigit() and int(p) not in mine))
print("tmp", sorted(p for p in os.listdir("/tmp") if os.stat("/tmp/" + p).st_uid == os.getuid()),  # not mount points
      "cwd", os.getcwd(), os.listdir("."))
print("shm", ctypes.CDLL(None).shmget(4242, 0, 0))
print("uid", os.getuid(), "capabilities", open("/proc/self/status").read().split("CapEff:")[1].split()[0])
try:
    os.listdir(f"/proc/{os.getppid()}/fd")
    print("zygote fds readable")
except PermissionError:
    print("zygote fds hidden")
for shared in (os.environ["IPYTHONDIR"], os.path.dirname(os.environ["JUPYTER_RUNTIME_DIR"] + "/x")):
    try:
        open(os.path.join(shared, "filler"), "w").write("x")
        print("wrote into", shared)
    except PermissionError:
        pass
import threading
def vm_mb(): return int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) >> 10
before, barrier, held = vm_mb(), threading.Barrier(9), []
def allocate():  # a 100 kB block comes from the thread's malloc arena (rank threads do this)
    held.append(bytearray(100_000)); barrier.wait(); barrier.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
barrier.wait(); print("8 threads take", vm_mb() - before, "MB of address space"); barrier.wait()
for t in threads: t.join()
written = 0
try:
    for i in range(40):  # 40 x 64 MB: far beyond the quota
        with open(f"filler{i}", "wb") as f:
            f.write(bytes(64 << 20))
        written += 64
except OSError as e:
    print("disk full after", written, "MB:", e.strerror)
"""


def _job(tmp_path: Path, name: str, source: str) -> Path:
    job = tmp_path / name
    job.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), job / "prepared.ipynb")
    (job / "job.json").write_text(json.dumps({"cell_timeout": 60}))
    return job


def _text(job: Path) -> str:
    cell = nbformat.read(job / "executed.ipynb", as_version=4).cells[0]
    return "".join(o.get("text", "") for o in cell.outputs)


def test_a_submission_leaves_nothing_for_the_next(tmp_path):
    os.chmod(tmp_path, 0o755)
    slot = tmp_path / "slot0"
    sandbox.empty(slot)
    sandbox.hand_over(slot, 0)
    zygote = sandbox.Zygote(slot, 0)
    try:
        first, second = _job(tmp_path, "first", LEAVE), _job(tmp_path, "second", LOOK)
        assert sandbox.run(first, slot, 0, zygote)["status"] == "graded"
        assert "left True" in _text(first)
        assert zygote.wait_clean()
        sandbox.empty(slot)  # what the pipeline does between two submissions (autograde.prepare)
        sandbox.hand_over(slot, 0)
        result = sandbox.run(second, slot, 0, zygote)
        assert zygote.wait_clean()
    finally:
        zygote.close()
    assert result["status"] == "graded" and result["kernel_start_seconds"] < 5
    seen = _text(second)
    assert "processes []" in seen, seen
    assert "tmp ['work'] cwd /tmp/work" in seen and "note-in-my-folder" not in seen and "shm -1" in seen, seen
    assert "wrote into" not in seen, seen
    full = re.search(r"disk full after (\d+) MB: No space left on device", seen)
    assert full and int(full.group(1)) <= sandbox.LIMITS["tmp_mb"], seen
    # the cap counts address space: each thread's own malloc arena would reserve 64 MB of it (576 MB here)
    taken = re.search(r"8 threads take (\d+) MB of address space", seen)
    assert taken and int(taken.group(1)) <= 200, seen
    assert "capabilities 0000000000000000" in seen and "zygote fds hidden" in seen, seen
    if os.geteuid() == 0:
        assert f"uid {sandbox.UID_BASE} " in seen, seen


def test_without_the_sandbox_the_kernel_still_runs_and_its_processes_are_stopped(tmp_path, monkeypatch):
    """`make autograde UNSAFE_NO_SANDBOX=1`: resource limits only, the same zygote; what the kernel started in
    its own session is killed when it ends."""
    monkeypatch.setenv("GRADER_NO_SANDBOX", "1")
    slot = tmp_path / "slot0"
    sandbox.empty(slot)
    marker = f"sleep {300 + os.getpid() % 97}"
    job = _job(tmp_path, "job", f"import subprocess, torch\nsubprocess.Popen({marker.split()!r})\nprint(torch.ones(2).sum().item())")
    zygote = sandbox.Zygote(slot, 0)
    try:
        assert sandbox.run(job, slot, 0, zygote)["status"] == "graded"
        assert zygote.wait_clean()
    finally:
        zygote.close()
    assert "2.0" in _text(job)
    assert marker not in _command_lines()


def _command_lines() -> list[str]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip())
        except OSError:  # ended while we looked
            pass
    return lines
