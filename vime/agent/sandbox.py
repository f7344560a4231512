"""Run one tool call in a sandbox: a fresh process with no network, a read-only file system, a private
temporary folder, and limits on time, memory, processes and output.

An agent's tool runs on what the model wrote, so every call gets its own
process (``python -I``). The process imports the tool function -- the
user's code, trusted like a ``--custom-reward`` -- then confines itself
before calling it with the model's arguments (:data:`_CHILD`):

* a new network namespace (no interface but a downed loopback: connecting
  anywhere fails) and a new mount namespace in which every mount is made
  read-only, with a fresh size-limited tmpfs at ``/tmp`` (its working folder
  and ``TMPDIR``) and another over ``/dev/shm``;
* resource limits: address space (memory), CPU seconds, file size, open
  files, no core dumps; ``no_new_privs``; then every capability is dropped,
  so the code cannot undo any of it;
* a pids cgroup (when the machine lets us make one) caps its processes, so a
  fork bomb stalls instead of taking the host down; the parent kills the
  whole group when the call ends.

The parent enforces the wall-clock limit and reads at most ``output_bytes``
of the answer. Whatever goes wrong -- the tool raising, a hang, a crash, a
MemoryError, too much output -- comes back as an :class:`Outcome` with
``ok=False`` and an error text for the model; nothing raises into the
caller. Linux only; the namespaces need root or unprivileged user
namespaces.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

_CGROUP_ROOT = Path("/sys/fs/cgroup/pids")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one tool call may use."""

    seconds: float = 10.0  # wall clock; CPU time is capped at the same
    memory_mb: int = 512  # address space
    output_bytes: int = 16 << 10  # of the result the model sees
    processes: int = 16  # with a pids cgroup
    disk_mb: int = 64  # the private /tmp


@dataclasses.dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str  # the tool's result as text (JSON for non-strings), or the error for the model
    seconds: float


def run(function: str, arguments: dict[str, Any], limits: Limits = Limits()) -> Outcome:
    """Call ``function`` (``package.module:name``) with ``arguments`` in a sandbox."""
    started = time.monotonic()
    cgroup = _make_cgroup(limits.processes)
    request = json.dumps({"function": function, "arguments": arguments, "limits": dataclasses.asdict(limits),
                          "cgroup": str(cgroup) if cgroup else "", "path": _import_path()})
    child = subprocess.Popen([sys.executable, "-I", "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, start_new_session=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
    try:
        output, error = _exchange(child, request.encode(), limits)
    finally:
        _kill(child, cgroup)
    seconds = time.monotonic() - started
    if error:
        return Outcome(False, error, seconds)
    try:
        answer = json.loads(output)
    except json.JSONDecodeError:
        return Outcome(False, f"the tool process died without an answer (exit status {child.returncode})", seconds)
    return Outcome(answer["ok"], answer["output"], seconds)


def _exchange(child: subprocess.Popen, request: bytes, limits: Limits) -> tuple[bytes, str]:
    """Send the request, read the answer; an error text when the limits were hit."""
    try:
        child.stdin.write(request)
        child.stdin.close()
    except BrokenPipeError:  # it died at once; reading finds nothing and says so
        pass
    deadline = time.monotonic() + limits.seconds
    output = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(output), f"the tool call took longer than {limits.seconds:g} s and was stopped"
            if not selector.select(timeout=left):
                continue
            chunk = os.read(child.stdout.fileno(), 65536)
            output += chunk
            if not chunk or b"\n" in chunk:  # the answer is one line; children of the tool may hold the pipe
                return bytes(output).split(b"\n")[0], ""
            if len(output) > limits.output_bytes + 4096:  # room for the JSON around the result
                return bytes(output), f"the tool's output exceeded {limits.output_bytes} bytes and was cut off"


def _kill(child: subprocess.Popen, cgroup: Path | None) -> None:
    """End the call's process group and everything in its cgroup (a fork bomb's children too)."""
    for _ in range(50):
        pids = _cgroup_pids(cgroup)
        for pid in pids:
            _signal(pid)
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.poll()
        if not pids:
            break
        time.sleep(0.02)
    child.wait()
    if cgroup is not None:
        try:
            cgroup.rmdir()
        except OSError:
            pass


def _signal(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cgroup_pids(cgroup: Path | None) -> list[int]:
    if cgroup is None:
        return []
    try:
        return [int(line) for line in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _make_cgroup(processes: int) -> Path | None:
    """A pids cgroup for one call, or None where this process may not make one (then only the
    process group bounds it)."""
    folder = _CGROUP_ROOT / f"vime-sandbox-{uuid.uuid4().hex[:12]}"
    try:
        folder.mkdir()
        (folder / "pids.max").write_text(str(processes))
    except OSError:
        return None
    return folder


def processes_limited() -> bool:
    """Whether this process can give a call a pids cgroup (root, or a delegated cgroup); without one,
    a fork bomb is stopped only by the time limit and the kill of its process group."""
    folder = _make_cgroup(1)
    if folder is not None:
        folder.rmdir()
    return folder is not None


def _import_path() -> list[str]:
    """Where the child finds vime and the tool's package: this process's import path."""
    return [entry for entry in sys.path if entry and Path(entry).exists()]


# The child imports the tool, confines itself, then calls the tool. Written against the raw Linux
# interfaces (ctypes), since Python 3.11 has no os.unshare.
_CHILD = r'''
import ctypes, importlib, json, os, resource, sys
request = json.loads(sys.stdin.read())
limits = request["limits"]
libc = ctypes.CDLL(None, use_errno=True)

answers = os.fdopen(os.dup(1), "w")  # the answer's own channel: what the tool prints goes nowhere
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

def answer(ok, output):
    text = output if isinstance(output, str) else json.dumps(output)
    cap = limits["output_bytes"]
    if len(text) > cap:
        text = text[:cap] + f"\n[output cut at {cap} characters]"
    answers.write(json.dumps({"ok": ok, "output": text}) + "\n")
    answers.flush()

sys.path[:0] = request["path"]
module, _, name = request["function"].partition(":")
tool = getattr(importlib.import_module(module), name)

def check(result, what):
    if result != 0:
        raise OSError(ctypes.get_errno(), f"sandbox set-up failed: {what}: {os.strerror(ctypes.get_errno())}")

if request["cgroup"]:
    with open(os.path.join(request["cgroup"], "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
if os.geteuid() != 0:
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(CLONE_NEWUSER), "unshare(user)")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as mapping:
            mapping.write(text)
check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(mount, network)")
MS_REC, MS_PRIVATE = 0x4000, 0x40000
check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")

class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

MOUNT_ATTR_RDONLY, AT_RECURSIVE, AT_FDCWD, SYS_MOUNT_SETATTR = 0x1, 0x8000, -100, 442
attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)),
      "read-only mounts")
size = f"size={limits['disk_mb']}m,mode=1777".encode()
for folder in (b"/tmp", b"/dev/shm"):
    check(libc.mount(b"tmpfs", folder, b"tmpfs", 0, size), f"tmpfs on {folder.decode()}")
os.chdir("/tmp")
os.environ.update(TMPDIR="/tmp", HOME="/tmp")
memory = limits["memory_mb"] << 20
cpu = int(limits["seconds"]) + 1
for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_FSIZE, limits["disk_mb"] << 20), (resource.RLIMIT_NOFILE, 64)):
    resource.setrlimit(limit, (value, value))
PR_SET_NO_NEW_PRIVS = 38
check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")

class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

PR_CAPBSET_DROP, LINUX_CAPABILITY_VERSION_3 = 24, 0x20080522
for capability in range(64):
    libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
check(libc.capset(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), (CapData * 2)()), "drop capabilities")

try:
    answer(True, tool(**request["arguments"]))
except MemoryError:
    answer(False, f"the tool ran out of memory (limit {limits['memory_mb']} MB)")
except BaseException as error:
    answer(False, f"{type(error).__name__}: {error}")
'''
