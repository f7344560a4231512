"""Reward functions written the way a user writes them, for the plug-in tests.

Spawned actors import this module by name (the tests put this folder on
PYTHONPATH), exactly as they would import a user's ``--custom-reward``.
"""

import itertools
import zlib


async def label_length(response: str, label: str, **metadata) -> float:
    """Async, and uses the label and metadata: len(label) / 10, plus any ``bonus``."""
    return len(label) / 10 + float(metadata.get("bonus", 0.0))


def no_metadata(response: str, label: str) -> float:
    """Breaks the contract: it cannot take metadata keywords."""
    return 0.0


def says_yes(response: str, label: str, **metadata) -> str:
    """Breaks the contract: returns a string."""
    return "yes"


def _spin_in_c() -> None:
    """Never returns, inside one C call with constant memory: no signal handler (math-verify's alarm) runs."""
    sum(itertools.repeat(1, 10**18))


def hangs_on_hang(response: str, label: str, **metadata) -> float:
    """Plain; spins forever in C when the response says "hang", else 1.0 for the label."""
    if "hang" in response:
        _spin_in_c()
    return 1.0 if response.strip() == label else 0.0


async def waits_on_hang(response: str, label: str, **metadata) -> float:
    """Async; waits forever when the response says "hang" (a remote reward model that never answers)."""
    import trio

    if "hang" in response:
        await trio.sleep_forever()
    return 1.0 if response.strip() == label else 0.0


def prints_and_scores(response: str, label: str, **metadata) -> float:
    """Plain, and prints: what it prints must not reach the actor as an answer."""
    print("debug output", response)
    return 0.5


def hangs_on_some(response: str, label: str, **metadata) -> float:
    """Spins forever in C on about one response in twelve (by its text's CRC), else 1.0 when the label is in
    it: a run with it must go on, those samples scored 0."""
    if zlib.crc32(response.encode()) % 12 == 0:
        _spin_in_c()
    return 1.0 if label in response else 0.0


def starts_a_sleeper(response: str, label: str, **metadata) -> float:
    """Starts a process (as a reward running generated code would), writes its pid to the file named in
    ``metadata["pid_file"]``, then hangs."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(metadata["pid_file"], "w") as out:
        out.write(str(child.pid))
    _spin_in_c()
    return 0.0


def slow_on_slow(response: str, label: str, **metadata) -> float:
    """Plain; takes 3 s when the response says "slow" (a pathological answer that still ends), else 0.5 s."""
    import time

    time.sleep(3.0 if "slow" in response else 0.5)
    return 1.0
