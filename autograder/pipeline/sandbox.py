"""Execute prepared notebooks, one at a time per worker slot, with their kernels inside a bubblewrap sandbox.

Only the kernel, where learner code runs, is sandboxed: nbclient (this process) stays outside and talks to it
over ZMQ IPC sockets in a directory both sides see (with --unshare-net the kernel cannot reach the host's
loopback, so TCP would not work). The notebook itself never enters the sandbox: cells are sent one by one,
so learner code cannot read the hidden tests that come after it, nor the gradebook, references, solutions
or other submissions (all hidden behind empty tmpfs mounts).

Each slot's sandbox holds one zygote (zygote.py) that has torch & co imported and forks a fresh kernel per
submission; the slot's shared folders (SANDBOX_DIRS) are refilled by the pipeline between submissions, the
zygote gives each kernel a fresh copy of the submission's files in /tmp, empties /tmp and kills leftovers.

Run as `python -m autograder.pipeline.sandbox SLOT_DIR SLOT` (one long-lived process per slot, so a crash or a
memory blow-up here cannot take the pipeline down): it reads job directories on stdin, runs each
JOB/prepared.ipynb and writes JOB/executed.ipynb and JOB/result.json.
"""
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from . import COURSE, ROOT

UID_BASE = 61000  # one uid per worker slot, so RLIMIT_NPROC counts each sandbox on its own
LIMITS = {"memory_mb": 3072, "nproc": 200, "fsize_mb": 64, "cpu_s": 1200, "nofile": 512, "tmp_mb": 256}
BWRAP, PRLIMIT, SETPRIV = (shutil.which(p) for p in ("bwrap", "prlimit", "setpriv"))
OUTPUT_CAP = 1_000_000  # characters of output kept per cell; the rest is dropped at the source
TRUNCATED = "[grader: output truncated]"


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


# Per slot, shared with the pipeline outside: the submission's files (read-only inside: the zygote copies them
# to a fresh work folder in the size-limited /tmp for each kernel), the IPC sockets + connection file, the
# guard's one-shot config, IPython's profile. The last three are locked once the kernel is up (lock()).
SANDBOX_DIRS = ("inbox", "kernel", "guard", "ipython")


def _work_dir(slot_dir: Path) -> Path:
    """Where each kernel runs: in the sandbox's own /tmp (so /tmp's size limit is its disk quota)."""
    return slot_dir / "run" if os.environ.get("GRADER_NO_SANDBOX") else Path("/tmp/work")


def _kernel_env(slot_dir: Path) -> dict:
    work = _work_dir(slot_dir)
    return {"HOME": str(work), "LANG": "C.UTF-8", "IPYTHONDIR": str(slot_dir / "ipython"),
            "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(work / ".mpl"),
            "GRADER_GUARD": str(slot_dir / "guard" / "guard.json"), "OMP_NUM_THREADS": "1",
            "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "JUPYTER_RUNTIME_DIR": str(slot_dir / "kernel"),
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            # The memory cap limits address space, and glibc reserves 64 MiB of it for each thread's malloc arena:
            # chapter 8's rank threads reached 2.5 of the 3 GiB, and a kernel died of it in CI. Two arenas: 1.6 GiB.
            "MALLOC_ARENA_MAX": "2"}


def command(slot_dir: Path, slot: int, limits: dict = LIMITS) -> list[str]:
    """The prefix put in front of the slot's zygote command line (see autograder/README.md for each flag)."""
    if os.environ.get("GRADER_NO_SANDBOX"):  # the instructor opted out: resource limits only
        return [PRLIMIT, f"--as={limits['memory_mb'] << 20}", f"--fsize={limits['fsize_mb'] << 20}",
                f"--cpu={limits['cpu_s']}", "--core=0", "--"]
    cmd = [BWRAP, "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
           "--perms", "1777", "--size", str(limits["tmp_mb"] << 20), "--tmpfs", "/tmp",
           # a DataLoader with workers needs POSIX semaphores and shared memory, which live in /dev/shm
           "--perms", "1777", "--size", str(limits["tmp_mb"] << 20), "--tmpfs", "/dev/shm"]
    for d in _hidden_dirs():
        cmd += ["--tmpfs", d]
    for d in dict.fromkeys(_visible_again()):
        cmd += ["--ro-bind", d, d]
    for d in (slot_dir.parent, slot_dir):  # bwrap would create these 0700: unreadable for the sandbox uid
        cmd += ["--perms", "0755", "--dir", str(d)]
    for d in SANDBOX_DIRS:
        cmd += ["--ro-bind" if d == "inbox" else "--bind", str(slot_dir / d), str(slot_dir / d)]
    cmd += ["--ro-bind", str(Path(__file__).with_name("zygote.py")), str(slot_dir / "zygote.py"),
            "--chdir", "/tmp", "--clearenv"]
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", **_kernel_env(slot_dir)}
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
    """Why the sandbox cannot be used here, or None if a sandboxed process runs, is cut off from the net and
    can give each kernel its own user and IPC namespaces (what zygote.py does per submission)."""
    missing = [n for n, p in (("bwrap (Debian package bubblewrap)", BWRAP), ("prlimit (util-linux)", PRLIMIT))
               if not p]
    if os.geteuid() == 0 and not SETPRIV:
        missing.append("setpriv (util-linux)")
    if missing:
        return "missing " + ", ".join(missing)
    import tempfile
    with tempfile.TemporaryDirectory(prefix="mgpu-sandbox-check-") as tmp:
        job = Path(tmp)
        for d in SANDBOX_DIRS:
            (job / d).mkdir()
            os.chown(job / d, UID_BASE, UID_BASE) if os.geteuid() == 0 else None
        probe = ("import socket,os;s=socket.socket();s.settimeout(1)\n"
                 "try:\n s.connect(('127.0.0.1',22)); print('net')\nexcept OSError: print('nonet')\n"
                 f"print(os.path.exists({str(COURSE / 'autograder' / 'references')!r}))\n"
                 "import ctypes;print('userns' if ctypes.CDLL(None).unshare(0x18000000) == 0 else 'no-userns')")
        try:
            r = subprocess.run(command(job, 0) + [sys.executable, "-c", probe], capture_output=True, text=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap did not run: {e}"
        if r.returncode != 0:
            return f"bwrap failed (exit {r.returncode}): {r.stderr.strip()[-400:]}"
        if r.stdout.split()[:2] != ["nonet", "False"]:
            return f"sandbox is leaky: {r.stdout!r}"
        if r.stdout.split()[2:] != ["userns"]:
            return "unprivileged user namespaces are disabled (sysctl kernel.unprivileged_userns_clone / AppArmor)"
    return None


class KernelProcess:
    """A forked kernel as the Popen-like object jupyter_client's provisioner expects (poll/wait/signals)."""
    stdin = stdout = stderr = None

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None
        self.ended = threading.Event()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        self.ended.wait(timeout)
        return self.returncode

    def send_signal(self, signum):
        if self.returncode is None:
            self.zygote.request({"signal": int(signum)})

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The slot's sandboxed zygote (zygote.py) seen from outside: started once, forks one kernel per job."""

    def __init__(self, slot_dir: Path, slot: int, limits: dict = LIMITS, log=subprocess.DEVNULL):
        t0 = time.monotonic()
        unsandboxed = bool(os.environ.get("GRADER_NO_SANDBOX"))
        # Inside the sandbox the repo is hidden: zygote.py is mounted read-only into the slot (command()).
        script = Path(__file__).with_name("zygote.py") if unsandboxed else slot_dir / "zygote.py"
        argv = [sys.executable, str(script), str(slot_dir / "inbox"), str(_work_dir(slot_dir))]
        if not unsandboxed:
            argv.append("--own-pid-namespace")
        self.proc = subprocess.Popen(command(slot_dir, slot, limits) + argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                     env=_zygote_env(slot_dir) if unsandboxed else None)
        self.replies, self.kernel, self.gone = queue.Queue(), None, False
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", 300)
        self.start_seconds = round(time.monotonic() - t0, 2)

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "exited" in msg and self.kernel:
                self.kernel.returncode = msg["exited"]
                self.kernel.ended.set()
            self.replies.put(msg)
        if self.kernel and self.kernel.returncode is None:  # the zygote died (killed?): so did its kernel
            self.kernel.returncode = -signal.SIGKILL
            self.kernel.ended.set()
        self.gone = True
        self.replies.put({"gone": True})

    def request(self, msg: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the zygote is gone; _read has marked the kernel dead

    def expect(self, key: str, timeout: float):
        """The next reply carrying key (skipping others); raises RuntimeError if the zygote dies or stalls."""
        deadline = time.monotonic() + timeout
        while True:
            if self.gone and self.replies.empty():
                raise RuntimeError(f"zygote died (exit {self.proc.wait()}) waiting for {key!r}")
            try:
                msg = self.replies.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"zygote sent no {key!r} in {timeout:.0f} s") from None
            if "gone" in msg:
                raise RuntimeError(f"zygote died (exit {self.proc.wait()}) waiting for {key!r}")
            if key in msg:
                return msg[key]

    def spawn(self, args: list[str]) -> KernelProcess:
        self.request({"spawn": args})
        self.kernel = KernelProcess(self, self.expect("spawned", 30))
        return self.kernel

    def wait_clean(self, timeout: float = 60) -> bool:
        """True once the last kernel's leftovers are gone and the slot may take the next submission."""
        try:
            if self.kernel is not None:
                self.expect("clean", timeout)
            return True
        except RuntimeError:
            return False
        finally:
            self.kernel = None

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _zygote_env(slot_dir: Path) -> dict:
    """Without bwrap (the opt-out), the zygote still gets the sandbox's environment, via Popen."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(_kernel_env(slot_dir))
    return env


def _kernel_manager(slot_dir: Path, slot: int, zygote: Zygote):
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning import LocalProvisioner

    class ZygoteProvisioner(LocalProvisioner):
        """Launches the kernel by asking the slot's zygote to fork one, instead of starting a new Python."""

        async def launch_kernel(self, cmd, **kwargs):
            self.process = zygote.spawn(cmd[cmd.index("-f"):])
            self.pid, self.pgid = self.process.pid, None
            return self.connection_info

    class SlotKernelManager(AsyncKernelManager):
        """An ordinary IPython kernel forked inside the slot's sandbox, connected over IPC."""

        def write_connection_file(self, **kwargs):
            super().write_connection_file(**kwargs)
            if os.geteuid() == 0:
                os.chown(self.connection_file, UID_BASE + slot, UID_BASE + slot)

    km = SlotKernelManager(kernel_name="python3", transport="ipc", ip=str(slot_dir / "kernel" / "k"),
                           connection_file=str(slot_dir / "kernel" / "kernel.json"))
    km.kernel_id = str(uuid.uuid4())
    km.provisioner = ZygoteProvisioner(kernel_id=km.kernel_id, kernel_spec=km.kernel_spec, parent=km)
    return km


def empty(slot_dir: Path) -> None:
    """Remove what the previous submission of this slot left in the shared folders (the mounts stay)."""
    for d in SANDBOX_DIRS:
        (slot_dir / d).mkdir(parents=True, exist_ok=True)
        for entry in (slot_dir / d).iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def hand_over(slot_dir: Path, slot: int) -> None:
    """The shared folders, once filled for the next submission, become the slot's uid's (as root)."""
    for d in SANDBOX_DIRS:
        os.chmod(slot_dir / d, 0o755)
    _chown(slot_dir, UID_BASE + slot)


def lock(slot_dir: Path) -> None:
    """Once the kernel is up (sockets bound, guard config read, profile made), learner code gets no more room
    on this disk: the shared folders become root's. (Run as root only; else they stay the instructor's.)"""
    _chown(slot_dir, 0)


def _chown(slot_dir: Path, uid: int) -> None:
    if os.geteuid() == 0:
        for d in SANDBOX_DIRS:
            for p in [slot_dir / d, *(slot_dir / d).rglob("*")]:
                os.lchown(p, uid, uid)


def run(job: Path, slot_dir: Path, slot: int, zygote: Zygote) -> dict:
    """Execute job/prepared.ipynb in a kernel forked by zygote; return {"status": ..., "seconds": ...}."""
    import nbformat
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    spec = json.loads((job / "job.json").read_text())
    nb = nbformat.read(job / "prepared.ipynb", as_version=4)

    class CappedClient(NotebookClient):
        """Drops output beyond OUTPUT_CAP characters per cell as it arrives (100 MB of prints stays cheap), all
        but errors and the guard's one-line verdicts: without them a long test would read as tampering."""
        sizes: dict = {}

        def output(self, outs, msg, display_id, cell_index):
            if msg.get("msg_type") == "error":  # a failing test must show its error whatever was printed before
                return super().output(outs, msg, display_id, cell_index)
            content = msg.get("content", {})
            n = len(content.get("text", "")) + sum(len(str(v)) for v in content.get("data", {}).values())
            before = self.sizes.get(cell_index, 0)
            self.sizes[cell_index] = before + n
            if before + n > OUTPUT_CAP:
                if before <= OUTPUT_CAP:
                    outs.append(nbformat.v4.new_output("stream", name="stdout", text=f"\n{TRUNCATED}\n"))
                verdicts = [line for line in content.get("text", "").split("\n")
                            if spec["nonce"] in line and f"{spec['nonce']} check " not in line and len(line) < 1000]
                if verdicts:
                    outs.append(nbformat.v4.new_output("stream", name="stdout", text="\n".join(verdicts) + "\n"))
                return None
            return super().output(outs, msg, display_id, cell_index)

    km = _kernel_manager(slot_dir, slot, zygote)
    client = CappedClient(nb, km=km, timeout=spec["cell_timeout"],
                          allow_errors=True, interrupt_on_timeout=False, startup_timeout=120,
                          extra_arguments=["--HistoryManager.hist_file=:memory:"],
                          record_timing=True)
    t0 = time.monotonic()
    status, failed_cell = "graded", None
    try:
        with client.setup_kernel():
            started = time.monotonic() - t0
            lock(slot_dir)
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
    finally:
        if km.has_kernel:  # we own the kernel (nbclient only shuts down those it started): outputs are in
            run_sync(km.shutdown_kernel)(now=True)
    nbformat.write(nb, job / "executed.ipynb")
    total = time.monotonic() - t0
    return {"status": status, "failed_cell": failed_cell, "seconds": round(total, 2),
            "kernel_start_seconds": round(locals().get("started", total), 2)}


def serve(slot_dir: Path, slot: int) -> None:
    """Worker loop: job directories in on stdin, one line out per finished job (its result.json is written).

    The zygote is started on the first job and kept; if it dies or cannot clean up after a submission, the
    next job gets a fresh one (and a fresh sandbox)."""
    zygote = None
    log = open(slot_dir.parent / f"{slot_dir.name}.log", "ab") if os.environ.get("GRADER_DEBUG") else subprocess.DEVNULL
    for line in sys.stdin:
        job = Path(line.strip())
        result, zygote_seconds = None, None
        try:
            if zygote is None:
                zygote = Zygote(slot_dir, slot, log=log)
                zygote_seconds = zygote.start_seconds
            result = run(job, slot_dir, slot, zygote)
        except Exception as e:  # the pipeline reports it as "failed: sandbox error" and retries next time
            result = {"status": f"failed: sandbox error: {type(e).__name__}: {e}"[:300], "failed_cell": None}
        if zygote is not None and not zygote.wait_clean():
            zygote.close()
            zygote = None
        result["zygote_start_seconds"] = zygote_seconds
        (job / "result.json").write_text(json.dumps(result))
        print(job, flush=True)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]))
