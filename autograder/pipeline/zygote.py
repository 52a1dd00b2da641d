"""One worker slot's kernel zygote: imports torch and friends once, then forks a fresh kernel per submission.

Starting a kernel costs ~4 s of CPU (Python, ipykernel, torch, matplotlib, the course) and the first
emulated op ~2.5 s more (lazy imports): as much as running a whole chapter. This process pays that once per slot, inside the slot's sandbox, as the
slot's unprivileged uid, and never runs learner code itself. Each kernel is a fork of it that gets its own
user and IPC namespaces (no SysV/POSIX IPC or keyrings carried over), no capabilities, reseeded RNGs, and
the per-submission guard (an IPython startup file, as before). When a kernel ends, every process it left
is killed and /tmp emptied before the next submission of this slot may start.

Run by sandbox.Zygote as `python zygote.py INBOX WORK [--own-pid-namespace]`: each kernel starts in WORK, a
fresh copy of the submission's files from INBOX (in the sandbox WORK is in /tmp, so /tmp's size limit is
the submission's whole disk quota). It speaks JSON lines on the pipes it was started with (learner code
cannot reach them: the kernel gets /dev/null, and this process is not dumpable, so /proc/<pid>/fd and
ptrace are closed to the same uid):
  -> {"spawn": [kernel arguments]}   <- {"spawned": pid}
  -> {"signal": n}                   (for the running kernel)
                                     <- {"exited": returncode}, then {"clean": true}
"""
import ctypes
import json
import os
import random
import select
import shutil
import signal
import sys
import time
import traceback

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
CLONE_NEWUSER, CLONE_NEWIPC = 0x10000000, 0x08000000
libc = ctypes.CDLL(None, use_errno=True)


def preload() -> float:
    """Everything a chapter imports, imported before any submission is seen; returns the seconds it took."""
    t0 = time.monotonic()
    import ipykernel.kernelapp  # noqa: F401
    import ipywidgets  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import importlib
    import pkgutil

    import course
    for info in pkgutil.walk_packages(course.__path__, "course."):  # the guard snapshots all of them
        importlib.import_module(info.name)
    warm_up()
    return time.monotonic() - t0


def warm_up() -> None:
    """A few emulated ops in both modes: their first use imports torch._dynamo, torch.distributed.tensor and
    sympy (~2.5 s) lazily. No random numbers are drawn, so each kernel's RNGs start where a fresh one's would;
    the course's per-op cost caches it fills are pure functions of op and shape."""
    import torch
    import torch.nn.functional as F

    import course
    for materialize in (False, True):
        with course.emulate(gpus=2, materialize=materialize):
            x = torch.ones(8, 16, device="cuda:0", requires_grad=True)
            w = torch.ones(16, 16, device="cuda:0", requires_grad=True)
            kernel = torch.ones(2, 2, 3, 3, device="cuda:0", requires_grad=True)
            image = torch.ones(1, 2, 8, 8, device="cuda:0")
            (F.relu(F.linear(x, w) @ w).sum() + F.conv2d(image, kernel, padding=1).mean()).backward()
            torch.cuda.comm.broadcast(x.detach(), devices=[0, 1])
            x.detach().to("cuda:1").cpu()
            torch.cuda.synchronize()


def fresh_work_dir(inbox: str, work: str) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(inbox, work, symlinks=True)
    os.chdir(work)


def own_namespaces() -> None:
    """New user + IPC namespaces (same uid mapped to itself), then drop the capabilities they came with."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWIPC) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWIPC)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def kernel(args: list[str], channels: tuple[int, int], sandboxed: bool) -> None:
    """In the forked child: shed the zygote's channels and privileges, then become an ordinary ipykernel."""
    os.setsid()
    for fd in channels:
        os.close(fd)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # an ordinary process again (its /proc files were root's)
    if sandboxed:
        own_namespaces()
    random.seed()
    import numpy
    numpy.random.seed()
    sys.argv = ["ipykernel_launcher", *args]
    from ipykernel.kernelapp import IPKernelApp
    IPKernelApp.launch_instance(argv=args)


def clean(sandboxed: bool, kernel_pid: int) -> None:
    """Kill whatever the submission left running and empty /tmp; exit (the slot restarts) if that fails."""
    me = os.getpid()
    for _ in range(200):
        if sandboxed:  # own pid namespace, own uid: -1 reaches exactly the submission's processes
            others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
            if not others:
                break
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:  # the instructor opted out of the sandbox: only the kernel's own session can be reached
            try:
                os.killpg(kernel_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break
        reap()
        time.sleep(0.01)
    else:
        sys.exit("zygote: processes left by a submission would not die")
    os.chdir("/")
    if sandboxed:
        for entry in os.scandir("/tmp"):
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # the sandbox's own mount points (the slot's folders may live under /tmp)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def reap() -> list[tuple[int, int]]:
    """Collect every exited child (orphans included: this process is a subreaper); (pid, returncode) pairs."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, os.waitstatus_to_exitcode(status)))


def main() -> None:
    inbox, work = sys.argv[1:3]
    sandboxed = "--own-pid-namespace" in sys.argv
    # The protocol pipes move off fds 0/1 so nothing printed during imports (or inherited) can reach them.
    rx, tx = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def send(msg):
        os.write(tx, (json.dumps(msg) + "\n").encode())

    fresh_work_dir(inbox, work)  # matplotlib finds its font cache (MPLCONFIGDIR) in there
    send({"ready": round(preload(), 2)})
    child, buffer = None, b""
    while True:
        if select.select([rx], [], [], 0.05)[0]:
            data = os.read(rx, 1 << 16)
            if not data:
                return  # the worker is gone
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                if "spawn" in request and child is None:
                    fresh_work_dir(inbox, work)
                    child = os.fork()
                    if child == 0:
                        code = 1
                        try:
                            kernel(request["spawn"], (rx, tx), sandboxed)
                            code = 0
                        except SystemExit as e:
                            code = e.code if isinstance(e.code, int) else 1
                        except BaseException:
                            traceback.print_exc()  # to the zygote's stderr: the worker's log, never the notebook
                        finally:
                            os._exit(code)
                    send({"spawned": child})
                elif "spawn" in request:
                    send({"error": "a kernel is still running"})
                elif "signal" in request and child is not None:
                    try:
                        os.kill(child, request["signal"])
                    except ProcessLookupError:
                        pass
        for pid, code in reap():
            if pid == child:
                send({"exited": code})
                clean(sandboxed, child)
                child = None
                send({"clean": True})


if __name__ == "__main__":
    main()
