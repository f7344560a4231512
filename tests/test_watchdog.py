"""The test watchdog (conftest.py): a hung test fails with the stacks of its process and of its actors.

Issue 32 saw a resumed driver hang once in CI with nothing to show for it until CI's own limit. Here an
inner pytest run (the same conftest) starts a real actor and then waits forever; with the watchdog set to a
few seconds it must fail the test with :class:`conftest.Hung`, and the actor's log must hold its stacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HANGING = '''
import trio

from conftest import open_job
from vime.scenarios.selfcheck import ECHO


async def test_waits_forever(tmp_path):
    async with open_job(tmp_path / "job") as job:
        await job.spawn(ECHO, "echo0")
        await trio.sleep_forever()
'''


def test_a_hung_test_fails_with_the_stacks_of_its_actors(tmp_path: Path) -> None:
    tests = Path(__file__).parent
    (tmp_path / "test_hangs.py").write_text(HANGING)
    env = dict(os.environ, VIME_TEST_WATCHDOG_S="20", PYTHONPATH=str(tests))  # tests/conftest.py, as a plugin
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-o",
                          "trio_mode=true", "--basetemp",
                          str(tmp_path / "base"), str(tmp_path / "test_hangs.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "Hung: " in run.stdout and "ran past 20 s" in run.stdout, run.stdout[-3000:]
    logs = list((tmp_path / "base").rglob("echo0.log"))
    assert logs and "most recent call first" in logs[0].read_text(), [log.read_text()[-2000:] for log in logs]
