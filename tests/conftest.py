"""Shared fixtures: a running job (driver + real actor processes) in a temp folder, throw-away TLS files --
and the session's leak check.

The leak check: this session marks its environment (``VIME_TEST_SESSION``, inherited by every process it
starts, however deep) and gives vime a shared-memory folder of its own (``VIME_SHM_DIR``, where segments
and the driver's ipc sockets go). At the end, a process still carrying the mark, or anything left in that
folder, fails the run -- other users' vime processes and segments on the same machine are never looked at.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from hypothesis import settings

from vime import Cluster
from vime.devtools import certificates
from vime.logs import configure

configure("warning")

# Tests send SIGINT as a terminal's Ctrl-C does. A test run started in the background (``nohup``, ``&`` in a
# script) inherits SIGINT ignored, and would pass that on to every process it starts, which would then never
# see the Ctrl-C: handled here, it reaches them as the default again (a handler is reset by exec, "ignored" is
# not).
signal.signal(signal.SIGINT, signal.default_int_handler)

# Property tests draw the same examples on every run (derandomized, no example database), so that CI passes
# or fails on the code, not on the draw. HYPOTHESIS_PROFILE=explore draws new ones, the run that looks for
# failures: a failing example it finds is added to its test with @example and then holds in CI too.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SESSION_MARK = "VIME_TEST_SESSION"
WATCHDOG_S = float(os.environ.get("VIME_TEST_WATCHDOG_S", 1500))  # the longest test takes ~600 s on a busy 2-core CPU
LINGER_S = 15.0  # how long processes of the session may take to finish exiting once the tests are done
_OWN_SHM_DIR = pytest.StashKey[Path]()


@contextlib.asynccontextmanager
async def open_job(run_dir: Path, transport: str = "ipc", **kwargs: Any) -> AsyncIterator[Cluster]:
    async with Cluster.open(run_dir, transport=transport, **kwargs) as cluster:
        yield cluster


class Hung(Exception):
    """A test ran past ``WATCHDOG_S``."""


@pytest.fixture(autouse=True)
def watchdog(request: pytest.FixtureRequest) -> Any:
    """A test that runs past ``WATCHDOG_S`` fails, with every thread's stack of this process and of each actor
    it started, instead of hanging CI until its own limit (a resumed driver hung once so, and said nothing).

    A timer thread, not SIGALRM: math-verify's ``signal.alarm`` would cancel an interval timer. On expiry the
    actors of this session get SIGUSR1 (``vime.actor`` writes its stacks to its log) and the main thread a
    SIGUSR2 whose handler raises :class:`Hung` in whatever the test is doing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident

    def hang(signum: int, frame: Any) -> None:
        raise Hung(f"{request.node.nodeid} ran past {WATCHDOG_S:.0f} s (VIME_TEST_WATCHDOG_S): the stacks of this "
                   "process are in its captured stderr, each actor's in its log (after 'Current thread')")

    def expire() -> None:
        for pid, command in marked_processes(os.environ[SESSION_MARK]):
            if "vime.actor" in command:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        faulthandler.dump_traceback(all_threads=True)
        signal.pthread_kill(main, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, hang)
    timer = threading.Timer(WATCHDOG_S, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR2, previous)


@pytest.fixture(params=["ipc", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def make_tls_files(folder: Path, ca_name: str = "vime-test-ca") -> dict[str, str]:
    """Throw-away TLS files (:mod:`vime.devtools.certificates`); skips the test where openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    return certificates.make_tls_files(folder, ca_name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests are real tests; on a machine without CUDA they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine (see ../shared/device/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Mark this session's processes and give its segments a folder of its own, before any test starts. Under
    pytest-xdist's workers (pyproject's ``-n 2``) each process of the run, the tests' own and every actor and
    rank they start, gets one CPU thread for torch unless ``OMP_NUM_THREADS`` says otherwise: two tests at once
    on two cores, each with several processes of one thread per core, would spin on each other (torchrun gives
    its ranks one thread for the same reason)."""
    mark = os.environ.setdefault(SESSION_MARK, uuid.uuid4().hex)
    if (getattr(config.option, "numprocesses", None) or 0) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "VIME_SHM_DIR" not in os.environ:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        os.environ["VIME_SHM_DIR"] = tempfile.mkdtemp(prefix=f"vime-tests-{mark[:8]}-", dir=base)
        config.stash[_OWN_SHM_DIR] = Path(os.environ["VIME_SHM_DIR"])


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when its tests left vime processes running or files in the shared-memory folder. Last of
    the session's finishers: under pytest-xdist the workers (which inherit the mark and the folder, and so leave
    the check to the controller) have been shut down by then."""
    folder = session.config.stash.get(_OWN_SHM_DIR, None)
    if folder is None:  # an outer session owns the folder and the check (a pytest run inside a test)
        return
    leaks = leaked_processes(os.environ[SESSION_MARK], LINGER_S)
    for pid, command in leaks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = sorted(entry.name for entry in folder.iterdir())
    shutil.rmtree(folder, ignore_errors=True)
    if not (leaks or left):
        return
    lines = [f"pid {pid}: {command}" for pid, command in leaks] + [f"{folder}/{name}" for name in left]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = "the tests left these behind (killed and removed now):\n  " + "\n  ".join(lines)
    if reporter is not None:
        reporter.write_sep("=", "leaked vime processes or shared memory", red=True)
        reporter.write_line(message)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_SCENARIO_MAINS = """
import contextlib, io, json, sys
import structlog
from vime import scenario
said = []
for argv in json.loads(sys.argv[1]):
    structlog.reset_defaults()  # nothing of one command's logging set-up goes on into the next
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = scenario.main(argv)
        except SystemExit as exit:
            code = exit.code
    said.append([code, err.getvalue()])
with open(sys.argv[2], "w") as out:
    json.dump(said, out)
"""


def scenario_mains(argvs: list[list[str]], env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """``python -m vime.scenario ARGV`` for each of ``argvs`` in turn, in one process of their own: (exit code,
    what it wrote to stderr) for each. For commands that end before any actor starts (a refusal, ``--dry-run``):
    each in a process of its own would import torch, and vLLM and megatron-core where the settings name them,
    again (5 to 20 s each on CI's machine); in this process (pytest's), the command line would configure its
    logging for good."""
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "said.json"
        done = subprocess.run([sys.executable, "-c", _SCENARIO_MAINS, json.dumps(argvs), str(out)], env=env,
                              capture_output=True, text=True, timeout=60 + 30 * len(argvs))
        assert done.returncode == 0, done.stderr[-3000:]
        said = json.loads(out.read_text())
    assert len(said) == len(argvs), said
    return [(code, stderr) for code, stderr in said]


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended: only its parent's wait is missing)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def every_sample(batch: Any) -> Any:
    """Every sample of ``batch`` (a TensorBatch) as one micro-batch on its device, for a trainer's single pass
    outside a step (its sizes read from the device, as a step reads them once)."""
    import torch

    from vime.backends.packing import SampleSizes, on_device

    rows = torch.arange(batch.input_ids.shape[0])
    return on_device([(rows, True)], SampleSizes.of(batch), batch.input_ids.device)[0]


def plain_sgd(engine: Any, lr: float = 0.1) -> None:
    """Plain SGD at a constant ``lr`` in place of the engine's AdamW, over the same parameter groups. AdamW's
    update for a gradient near its eps (1e-8) is about lr / 2 whatever the gradient's rounding, so float noise
    where one run has exactly 0 becomes lr-sized; and it is blind to a gradient's scale (a value model's
    gradient counted twice, or one left unclipped, would take the same step). SGD's update keeps noise at noise
    size and shows both. For the Megatron tests and their ranks (``megatron_tp_worker.py``)."""
    import torch

    engine.optimizer = torch.optim.SGD([{"params": group["params"]} for group in engine.optimizer.param_groups],
                                       lr=lr)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)


def leaked_processes(mark: str, linger_s: float = 0.0) -> list[tuple[int, str]]:
    """Processes other than this one whose environment carries ``VIME_TEST_SESSION=mark``, after giving
    them ``linger_s`` to exit; each with its command line."""
    deadline = time.monotonic() + linger_s
    while True:
        found = marked_processes(mark)
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def _ends_with_this_process(parent: int, command: str) -> bool:
    """Whether a process is a helper that a library started for this very process and that ends when it does,
    hence no leak of a test's: multiprocessing's resource tracker or fork server (our child; the fork server
    forks the multi-rank tests' ranks, :mod:`forked_ranks`), or one of torch.compile's pool of compile workers (a
    GPU test's compiled log-probs start 16), which watch the process their --parent names."""
    if "multiprocessing.resource_tracker" in command or "multiprocessing.forkserver" in command:
        return parent == os.getpid()
    return "torch/_inductor/compile_worker" in command and f"--parent={os.getpid()} " in f"{command} "


def marked_processes(mark: str) -> list[tuple[int, str]]:
    """Live processes (not zombies) but this one carrying ``VIME_TEST_SESSION=mark``; each with its command."""
    needle = f"{SESSION_MARK}={mark}".encode()
    found: list[tuple[int, str]] = []
    if not Path("/proc").is_dir():  # not Linux: nothing to read the environments from
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if _ends_with_this_process(int(parent), command):
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append((int(entry.name), command))
    return found
