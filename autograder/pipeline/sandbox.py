"""Execute one prepared notebook with its kernel inside a bubblewrap sandbox.

Only the kernel, where learner code runs, is sandboxed: nbclient (this process) stays outside and talks to it
over ZMQ IPC sockets in a directory both sides see (with --unshare-net the kernel cannot reach the host's
loopback, so TCP would not work). The notebook itself never enters the sandbox: cells are sent one by one,
so learner code cannot read the hidden tests that come after it, nor the gradebook, references, solutions
or other submissions (all hidden behind empty tmpfs mounts).

Run as `python -m autograder.pipeline.sandbox JOB_DIR` (one process per submission, so a crash or a memory
blow-up here cannot take the pipeline down); it reads JOB_DIR/job.json and writes JOB_DIR/executed.ipynb
and JOB_DIR/result.json.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import COURSE, ROOT

UID_BASE = 61000  # one uid per worker slot, so RLIMIT_NPROC counts each sandbox on its own
LIMITS = {"memory_mb": 3072, "nproc": 200, "fsize_mb": 64, "cpu_s": 1200, "nofile": 512, "tmp_mb": 256}
BWRAP, PRLIMIT, SETPRIV = (shutil.which(p) for p in ("bwrap", "prlimit", "setpriv"))
OUTPUT_CAP = 1_000_000  # characters of output kept per cell; the rest is dropped at the source


def _hidden_dirs() -> list[str]:
    """Folders learner code must not see: the course repo (and its .git), its parent, home directories."""
    dirs = [d for d in ("/root", "/home") if os.path.isdir(d)]
    for top in dict.fromkeys((ROOT, COURSE)):
        if top.parent != Path("/") and not str(top.parent).startswith(("/tmp", "/root", "/home")):
            dirs.append(str(top.parent))
        dirs.append(str(top))
    return dirs


def _visible_again() -> list[str]:
    """What the kernel needs from the hidden folders: the venv, its base python, the course package."""
    base = Path(os.path.realpath(sys.base_prefix))
    return [str(p) for p in (base, ROOT / ".venv", Path(sys.prefix), ROOT / "course") if p.exists()]


def command(job: Path, slot: int, limits: dict = LIMITS) -> list[str]:
    """The prefix put in front of the kernel command line (see autograder/README.md for each flag)."""
    if os.environ.get("GRADER_NO_SANDBOX"):  # the instructor opted out: resource limits only
        return [PRLIMIT, f"--as={limits['memory_mb'] << 20}", f"--fsize={limits['fsize_mb'] << 20}",
                f"--cpu={limits['cpu_s']}", "--core=0", "--"]
    cmd = [BWRAP, "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
           "--perms", "1777", "--size", str(limits["tmp_mb"] << 20), "--tmpfs", "/tmp"]
    for d in _hidden_dirs():
        cmd += ["--tmpfs", d]
    for d in dict.fromkeys(_visible_again()):
        cmd += ["--ro-bind", d, d]
    for d in (job.parent, job):  # bwrap would create these 0700: unreadable for the sandbox uid
        cmd += ["--perms", "0755", "--dir", str(d)]
    cmd += ["--bind", str(job / "work"), str(job / "work"), "--bind", str(job / "kernel"), str(job / "kernel"),
            "--bind", str(job / "guard"), str(job / "guard"), "--bind", str(job / "ipython"), str(job / "ipython"),
            "--chdir", str(job / "work"), "--clearenv"]
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(job / "work"), "LANG": "C.UTF-8",
           "IPYTHONDIR": str(job / "ipython"), "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(job / "work" / ".mpl"),
           "GRADER_GUARD": str(job / "guard" / "guard.json"), "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1",
           "PYTHONDONTWRITEBYTECODE": "1", "JUPYTER_RUNTIME_DIR": str(job / "kernel"), "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    for k, v in env.items():
        cmd += ["--setenv", k, v]
    cmd += ["--", PRLIMIT, f"--as={limits['memory_mb'] << 20}", f"--nproc={limits['nproc']}",
            f"--fsize={limits['fsize_mb'] << 20}", f"--cpu={limits['cpu_s']}", f"--nofile={limits['nofile']}",
            "--core=0", "--"]
    if os.geteuid() == 0:  # root ignores RLIMIT_NPROC: drop to an unprivileged uid of our own
        uid = str(UID_BASE + slot)
        cmd += [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]
    return cmd


def problem() -> str | None:
    """Why the sandbox cannot be used here, or None if a sandboxed process runs and is cut off from the net."""
    missing = [n for n, p in (("bwrap (Debian package bubblewrap)", BWRAP), ("prlimit (util-linux)", PRLIMIT))
               if not p]
    if os.geteuid() == 0 and not SETPRIV:
        missing.append("setpriv (util-linux)")
    if missing:
        return "missing " + ", ".join(missing)
    import tempfile
    with tempfile.TemporaryDirectory(prefix="mgpu-sandbox-check-") as tmp:
        job = Path(tmp)
        for d in ("work", "kernel", "guard", "ipython"):
            (job / d).mkdir()
            os.chown(job / d, UID_BASE, UID_BASE) if os.geteuid() == 0 else None
        probe = ("import socket,os;s=socket.socket();s.settimeout(1)\n"
                 "try:\n s.connect(('127.0.0.1',22)); print('net')\nexcept OSError: print('nonet')\n"
                 f"print(os.path.exists({str(COURSE / 'autograder' / 'references')!r}))")
        try:
            r = subprocess.run(command(job, 0) + [sys.executable, "-c", probe], capture_output=True, text=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap did not run: {e}"
        if r.returncode != 0:
            return f"bwrap failed (exit {r.returncode}): {r.stderr.strip()[-400:]}"
        if r.stdout.split() != ["nonet", "False"]:
            return f"sandbox is leaky: {r.stdout!r}"
    return None


def _kernel_manager(job: Path, slot: int, limits: dict):
    from jupyter_client.manager import AsyncKernelManager

    class SandboxKernelManager(AsyncKernelManager):
        """An ordinary IPython kernel, launched through the sandbox prefix, connected over IPC."""

        def format_kernel_cmd(self, extra_arguments=None):
            return command(job, slot, limits) + super().format_kernel_cmd(extra_arguments)

        def write_connection_file(self, **kwargs):
            super().write_connection_file(**kwargs)
            if os.geteuid() == 0:
                os.chown(self.connection_file, UID_BASE + slot, UID_BASE + slot)

    return SandboxKernelManager(kernel_name="python3", transport="ipc", ip=str(job / "kernel" / "k"),
                                connection_file=str(job / "kernel" / "kernel.json"))


def run(job: Path) -> dict:
    """Execute job/prepared.ipynb; return {"status": ..., "seconds": ...}; never raises for learner errors."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    spec = json.loads((job / "job.json").read_text())
    nb = nbformat.read(job / "prepared.ipynb", as_version=4)

    class CappedClient(NotebookClient):
        """Drops output beyond OUTPUT_CAP characters per cell as it arrives (100 MB of prints stays cheap)."""
        sizes: dict = {}

        def output(self, outs, msg, display_id, cell_index):
            content = msg.get("content", {})
            n = len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
            before = self.sizes.get(cell_index, 0)
            self.sizes[cell_index] = before + n
            if before + n > OUTPUT_CAP:
                if before <= OUTPUT_CAP:
                    return nbformat.v4.new_output("stream", name="stdout", text="\n[grader: output truncated]\n")
                return None
            return super().output(outs, msg, display_id, cell_index)

    km = _kernel_manager(job, spec["slot"], spec.get("limits", LIMITS))
    client = CappedClient(nb, km=km, timeout=spec["cell_timeout"], allow_errors=True, interrupt_on_timeout=False,
                          startup_timeout=120, extra_arguments=["--HistoryManager.hist_file=:memory:"],
                          resources={"metadata": {"path": str(job / "work")}}, record_timing=True)
    t0 = time.monotonic()
    status, failed_cell = "graded", None
    try:
        log = open(job / "kernel.log", "w") if os.environ.get("GRADER_DEBUG") else subprocess.DEVNULL
        with client.setup_kernel(stdout=log, stderr=log):
            started = time.monotonic() - t0
            for index, cell in enumerate(nb.cells):
                failed_cell = index
                client.execute_cell(cell, index)
            failed_cell = None
    except CellTimeoutError:
        status = "failed: timeout"
    except DeadKernelError:
        status = "failed: kernel died"
    except RuntimeError as e:  # e.g. "Kernel died before replying to kernel_info"
        status = "failed: kernel died" if "died" in str(e) else f"failed: sandbox error: {e}"
    else:
        pass
    nbformat.write(nb, job / "executed.ipynb")
    total = time.monotonic() - t0
    return {"status": status, "failed_cell": failed_cell, "seconds": round(total, 2),
            "kernel_start_seconds": round(locals().get("started", total), 2)}


if __name__ == "__main__":
    job_dir = Path(sys.argv[1])
    try:
        result = run(job_dir)
    except Exception as e:  # the pipeline reports it as "failed: sandbox error"
        result = {"status": f"failed: sandbox error: {type(e).__name__}: {e}"[:300], "failed_cell": None}
    (job_dir / "result.json").write_text(json.dumps(result))
