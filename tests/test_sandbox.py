"""The tool sandbox: each way a tool call can misbehave is stopped, reported to the model, and cleaned up."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vime.agent import sandbox
from vime.agent.calculator import SCHEMA, calculator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux namespaces")
LIMITS = sandbox.Limits(seconds=3.0)


def call(name: str, **arguments) -> sandbox.Outcome:
    return sandbox.run(f"sandbox_tools:{name}", arguments, LIMITS)


def leftovers() -> list[str]:
    """Sandbox processes still alive (none may outlive their call)."""
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in listing if "python -I -c" in line and "import ctypes, importlib" in line]


def test_a_tool_answers_through_the_sandbox():
    outcome = call("add", a=2, b=3)
    assert outcome.ok and outcome.output == "5" and outcome.seconds < 3


def test_an_endless_loop_is_stopped_at_the_time_limit():
    outcome = call("spin")
    assert not outcome.ok and "longer than 3 s" in outcome.output
    assert outcome.seconds < 5 and not leftovers()


def test_allocating_a_gigabyte_is_refused():
    outcome = call("allocate_a_gigabyte")
    assert not outcome.ok and "ran out of memory (limit 512 MB)" in outcome.output


def test_writes_outside_the_private_folder_fail_and_leave_nothing(tmp_path):
    in_the_repository = Path(__file__).parent / "escaped.txt"
    for target in (in_the_repository, tmp_path / "escaped.txt"):
        outcome = call("write", path=str(target))
        assert not outcome.ok and ("Read-only file system" in outcome.output or "No such file" in outcome.output)
        assert not target.exists()
    outcome = call("use_the_private_folder")
    assert outcome.ok and outcome.output == '["note.txt"]'
    assert not Path("/tmp/note.txt").exists()  # the sandbox's /tmp is its own


def test_no_network_connection_gets_out():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        outcome = call("connect", port=listener.getsockname()[1])
        assert not outcome.ok and "unreachable" in outcome.output.lower()
        with pytest.raises(TimeoutError):
            listener.accept()


def test_a_fork_bomb_is_contained_and_cleaned_up():
    outcome = call("fork_bomb")
    if not sandbox.processes_limited():  # only the time limit and the group kill stop it here
        assert not outcome.ok and "longer than" in outcome.output
    else:
        assert outcome.ok and "fork refused after 15 children" in outcome.output
    assert not leftovers()
    assert not list(Path("/sys/fs/cgroup/pids").glob("vime-sandbox-*"))


def test_oversized_output_is_cut_and_a_crash_is_reported():
    outcome = call("shout")
    assert outcome.ok and outcome.output.endswith("[output cut at 16384 characters]")
    assert len(outcome.output) < 17_000
    outcome = call("die")
    assert not outcome.ok and "died without an answer (exit status 3)" in outcome.output


def test_the_tool_cannot_undo_the_sandbox():
    outcome = call("remount_writable")
    assert not outcome.ok and "PermissionError" in outcome.output


def test_the_calculator_evaluates_arithmetic_and_refuses_the_rest():
    assert calculator("(16 - 3 - 4) * 2") == "18" and calculator("2^10") == "1024" and calculator("10/4") == "2.5"
    assert calculator("max(3, sqrt(49), 1)") == "7.0"
    for bad in ("__import__('os').system('true')", "open('x')", "(1).__class__"):
        with pytest.raises(ValueError, match="not allowed in a calculator expression"):
            calculator(bad)
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculator("1 +")
    assert SCHEMA["function"]["name"] == "calculator" and "sqrt" in SCHEMA["function"]["description"]
    outcome = sandbox.run("vime.agent.calculator:calculator", {"expression": "9**9**9**9"}, LIMITS)
    assert not outcome.ok  # too big to compute: stopped, not a dead worker
