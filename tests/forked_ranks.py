"""Ranks for the multi-rank Megatron tests, forked from one process that has imported torch, megatron-core and
vime's engine once, instead of torchrun's fresh interpreter per rank.

Why: on CI's two cores ``import megatron.core`` takes 5 to 10 s per process (a third of it torch.compile's
inductor, pulled in by megatron's fused kernels), and the multi-rank tests start about 140 ranks.

What a rank sees is what ``torchrun --standalone`` gives it: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a TCPStore hosted outside the ranks
(``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's agent does), one torch thread, and a session of its own, whose
processes are killed with it. The store is bound to port 0 by the test's process before any rank starts, so no
port is picked free and bound later. Departures: every rank has the fork server's string-hash seed (torchrun's
ranks each draw their own), and what the ranks inherit (environment, working folder) is the fork server's, fixed
when the first test of the process started it. One test still starts its ranks under real torchrun
(``test_the_leader_relays_every_field_of_a_batch_with_routed_experts``), and the tests of vime's own launcher (a
rank that dies, a leader that starts its own followers) start real interpreters.

The fork server (multiprocessing's) runs nothing but the imports, with ``OMP_NUM_THREADS=1`` so that they start
no OpenMP pool whose threads a fork would leave half-copied.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

GRACE_S = 5.0  # after one rank fails, how long the others get to notice before they are killed (torchrun's
# SIGTERM-then-SIGKILL, shortened: a rank waiting in a collective on a dead peer may never notice)
PRELOAD = ["megatron_tp_worker", "transformers.models.auto.configuration_auto", "safetensors.torch"]
LOG_TAIL = 2000  # characters of each failed rank's log in the error


def run_ranks(count: int, argv: list[object], logs: Path, timeout: float = 300.0) -> None:
    """Run ``megatron_tp_worker.run(argv)`` on ``count`` ranks of one gloo group; each rank's output goes to
    ``logs/rank{N}.log``. Raises AssertionError naming every rank that failed (or was still running at the
    timeout) with the end of its log, once no rank of the group is left running."""
    logs.mkdir(parents=True, exist_ok=True)
    context = _fork_server()  # first: it sets the environment for a moment, before the store's thread runs
    store = dist.TCPStore("127.0.0.1", 0, count, is_master=True, wait_for_workers=False)
    ranks = [context.Process(target=_rank, args=(rank, count, store.port, [str(arg) for arg in argv],
                                                 str(logs / f"rank{rank}.log")), name=f"rank{rank}")
             for rank in range(count)]
    try:
        for process in ranks:
            process.start()
        late = _wait(ranks, time.monotonic() + timeout)
    finally:  # an interrupted test (Ctrl-C, the watchdog) leaves no rank waiting on a dead group
        for process in ranks:
            _kill(process)
        for process in ranks:
            if process.pid is not None:
                process.join()
    exited = [(rank, f"exited with code {process.exitcode}") for rank, process in enumerate(ranks)
              if rank not in late and process.exitcode != 0]
    cut = f"was still running {GRACE_S:.0f} s after that (killed)" if exited else \
        f"was still running at the {timeout:.0f} s timeout (killed)"
    failed = sorted(exited + [(rank, cut) for rank in late])
    if failed:
        raise AssertionError(f"{len(failed)} of {count} ranks failed: "
                             + ", ".join(f"rank {rank} {why}" for rank, why in failed)
                             + "".join(f"\n--- the end of rank {rank}'s log:\n"
                                       + (logs / f"rank{rank}.log").read_text(errors="replace")[-LOG_TAIL:]
                                       for rank, _ in failed))


def _wait(ranks: list[multiprocessing.Process], deadline: float) -> list[int]:
    """Wait for every rank, giving the others :data:`GRACE_S` once one has failed; the ranks still running when
    the waiting ended (the caller kills them)."""
    running = {process.sentinel: rank for rank, process in enumerate(ranks)}
    while running:
        ready = multiprocessing.connection.wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return sorted(running.values())
        for sentinel in ready:
            running.pop(sentinel)
        if any(process.exitcode not in (None, 0) for process in ranks):
            deadline = min(deadline, time.monotonic() + GRACE_S)
    return []


def _kill(process: multiprocessing.Process) -> None:
    """A rank that is still running, and whatever it started (its session; the rank itself too when it has not
    made its session yet). One that has ended is left alone: the fork server has reaped it, and its number may be
    another process's by now."""
    if process.pid is not None and process.exitcode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()


def _fork_server() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's fork server, started (once per process) importing :data:`PRELOAD` with this folder on
    its path: Python 3.11's fork server imports its preloads before it applies the parent's ``sys.path``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    with mock.patch.dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"):
        multiprocessing.forkserver.ensure_running()
    return context


def _rank(rank: int, count: int, port: int, argv: list[str], log: str) -> None:
    """One rank, in a child of the fork server: torchrun's environment, output to ``log``, then the worker."""
    os.setsid()
    _die_with_the_fork_server()
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.stdout.reconfigure(line_buffering=True)  # a rank killed at the timeout keeps what it printed
    if "megatron_tp_worker" not in sys.modules:
        raise RuntimeError(f"the fork server could not import {PRELOAD[0]} (it says nothing of why: run `python -c "
                           f"'import {PRELOAD[0]}'` in tests/ to see the error), and each rank would import "
                           "megatron-core itself")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(count), LOCAL_WORLD_SIZE=str(count),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")  # OMP_NUM_THREADS=1: the fork server's
    torch.set_num_threads(1)
    sys.modules["megatron_tp_worker"].run(argv)


def _die_with_the_fork_server() -> None:
    """Have the kernel kill this rank when the fork server ends, as it does when the test's process dies: a rank
    of a killed pytest worker would otherwise wait on its group for ever. The server ends when it reads EOF from
    the test process's pipe, whose write end every child of the server inherits; so the rank closes its copy,
    after the kill is armed (the server may end as soon as it is closed)."""
    server = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != server:  # it ended before the line above
        os._exit(1)
    os.close(multiprocessing.forkserver._forkserver._forkserver_alive_fd)
    multiprocessing.forkserver._forkserver._forkserver_alive_fd = None  # its number is free for the next open
