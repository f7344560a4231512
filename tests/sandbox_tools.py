"""Tools for tests/test_sandbox.py: each misbehaves in one way a sandbox must stop."""

from __future__ import annotations

import os
import socket
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    print("chatter on stdout does not disturb the answer")
    return a + b


def spin() -> None:
    while True:
        pass


def allocate_a_gigabyte() -> int:
    return len(bytearray(1 << 30))


def write(path: str) -> str:
    with open(path, "w") as file:
        file.write("escaped")
    return "written"


def use_the_private_folder() -> list[str]:
    with open("/tmp/note.txt", "w") as file:
        file.write("kept inside")
    return sorted(os.listdir(os.environ["TMPDIR"]))


def connect(port: int) -> str:
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"


def fork_bomb() -> str:
    children = 0
    while True:
        try:
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
        except OSError as err:
            return f"fork refused after {children} children: {err}"
        children += 1


def shout() -> str:
    return "x" * (1 << 20)


def die() -> None:
    os._exit(3)


def remount_writable() -> str:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"none", b"/", None, 0x20 | 0x1000, None) == 0:  # MS_REMOUNT | MS_BIND, without MS_RDONLY
        return "remounted"
    raise PermissionError(os.strerror(ctypes.get_errno()))
