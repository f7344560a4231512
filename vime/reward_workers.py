"""Where a plain reward function runs: processes of its own, each call under a hard time limit.

The bug this exists to prevent: a reward that never returns stalls the run. ``math`` asks math-verify to stop
after 5 s, but math-verify stops itself with ``signal.alarm``, which works on a main thread only and not inside
a C call (sympy raising 9 to a tower of nines never returns to Python); a user's function may have no limit at
all. The reward actor would wait forever on one group while rollouts pile up behind it.

So a plain function (built-in or ``--custom-reward``) is called in one of ``--reward-workers`` processes of
its own. Each call may take ``--reward-timeout`` seconds; past that the process is killed, the sample scores
0 (a timed-out answer is not a right one), the call is counted, and a fresh process takes the killed one's
place. An ``async`` function is awaited in the actor under the same limit (it waits on I/O, where trio's
cancellation reaches it). A function that raises or returns something that is not a finite number still stops
the run, as ``vime.rewards.score`` says: that is a bug to fix, not an answer to score.

Only plain data crosses to a worker: msgpack maps of strings and the sample's metadata (never pickle), and
each worker finds the function itself from its name (``--reward``, ``--custom-reward``, ``--custom-rm-path``), told
in the first frame it reads; a ``--custom-rm-path`` function's worker is told the run's settings too (its ``args``)
and sent the sample's plain fields with each call (``vime.slime_reward``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from vime import rewards, slime_reward
from vime.config import RunConfig

START_S = 120.0  # a worker importing the function (and math-verify's sympy) may take a while on a busy host


@dataclass
class Scored:
    """One call's outcome: the reward, and whether the call was cut off (the reward is then 0): it ran past the
    limit, or its process died under it (killed for memory, say) -- an answer that breaks the scorer."""

    reward: float
    timed_out: bool = False


class WorkersClosed(RuntimeError):
    """The pool was closed (the actor is stopping) while a call waited or ran: nothing to score it with."""


class _Died(Exception):
    """A worker's process exited without answering."""


class RewardWorkers:
    """``workers`` processes that score samples with the reward ``name`` (or ``custom``, or slime's
    ``custom_rm_path`` with the run's ``settings`` as its ``args``), each call limited to ``limit_s`` seconds.
    :meth:`start` them, :meth:`close` them; :meth:`score` may be called concurrently."""

    def __init__(self, name: str, custom: str, workers: int, limit_s: float, custom_rm_path: str = "",
                 settings: dict[str, dict[str, Any]] | None = None) -> None:
        if workers < 1 or limit_s <= 0:
            raise ValueError(f"--reward-workers must be >= 1 (got {workers}) and --reward-timeout > 0 "
                             f"(got {limit_s})")
        self.size, self.limit_s = workers, limit_s
        # what a worker is told to find: plain values, sent as its first frame
        self.spec = {"name": name, "custom": custom, "custom_rm_path": custom_rm_path,
                     "settings": settings if custom_rm_path else None}
        self.fn = rewards.resolve(**self.spec)  # fails here, before any process starts, if it does not exist
        self.inline = rewards.is_async(self.fn)
        self.idle: list[_Worker] = []  # waiting for a call; with the busy ones, ``workers`` while open
        self.running: set[_Worker] = set()  # every process, idle or busy: close() kills them all
        self.free = trio.Semaphore(workers)
        self.closed = False
        self.timeouts = 0

    @classmethod
    def for_run(cls, config: RunConfig, workers: int | None = None) -> RewardWorkers:
        """The pool a run's reward settings ask for (``workers``: another number of processes)."""
        settings = config.reward
        return cls(settings.reward, settings.custom_reward, workers or settings.reward_workers,
                   settings.reward_timeout, settings.custom_rm_path, config.to_dict())

    def start(self) -> None:
        if not self.inline:
            for _ in range(self.size):
                self._add()

    def close(self) -> None:
        """Kill every worker, busy ones too; calls waiting or running end with WorkersClosed."""
        self.closed = True
        for worker in self.running:
            worker.stop()
        self.running.clear()
        self.idle = []

    async def score(self, response: str, label: str, metadata: dict[str, Any], sample: Any = None) -> Scored:
        """The reward of one response; 0 (and counted) when the call runs past the limit or its process dies.
        ``sample``: the rollout's ``Sample``, whose other fields a ``--custom-rm-path`` function's sample holds."""
        fields = slime_reward.sample_fields(sample) if sample is not None and self.spec["custom_rm_path"] else None
        if self.inline:
            with trio.move_on_after(self.limit_s):
                return Scored(await rewards.score(self.fn, response, label, metadata, fields))
            return self._timed_out()
        try:
            request = _frame({"response": response, "label": label, "metadata": metadata, "fields": fields})
        except (TypeError, ValueError) as err:
            raise TypeError(f"a sample cannot be sent to a reward worker ({err}): keep its metadata to plain "
                            "values (strings, numbers, lists, maps)") from None
        async with self.free:
            try:
                return await self._call(request)
            except trio.BrokenResourceError:  # the worker had died while idle: try once more on its replacement
                return await self._call(request)

    async def _call(self, request: bytes) -> Scored:
        """One try on an idle worker; any failure but an answer replaces the worker."""
        if self.closed:
            raise WorkersClosed("the reward actor is stopping")
        worker = self.idle.pop()
        try:
            reward = await worker.call(request, self.limit_s)
        except _Died:
            self._replace(worker)
            return self._timed_out()
        except trio.ClosedResourceError:  # close() closed its pipes under the call
            self._replace(worker)
            raise WorkersClosed("the reward actor is stopping") from None
        except BaseException:
            self._replace(worker)
            raise
        if reward is None:  # past the limit: the process is killed and replaced
            self._replace(worker)
            return self._timed_out()
        if self.closed:
            raise WorkersClosed("the reward actor is stopping")
        self.idle.append(worker)
        return Scored(reward)

    def _add(self) -> None:
        worker = _Worker.start(self.spec)
        self.running.add(worker)
        self.idle.append(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self.running.discard(worker)
        if not self.closed:
            self._add()

    def _timed_out(self) -> Scored:
        self.timeouts += 1
        return Scored(0.0, timed_out=True)


class _Worker:
    """One process (``python -m vime.reward_workers``) serving calls over its stdin and stdout, as length-prefixed
    msgpack frames: the first it reads names the function, and it says it is ready once it has found it. A process
    of its own rather than a multiprocessing child: spawn would import the actor's own modules (torch among them)
    into every worker."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process, self.ready, self.pending = process, False, b""
        self.stdin, self.stdout = (trio.lowlevel.FdStream(os.dup(pipe.fileno())) for pipe in (process.stdin,
                                                                                               process.stdout))
        process.stdin.close()
        process.stdout.close()

    @classmethod
    def start(cls, spec: dict[str, Any]) -> _Worker:
        """Started from the actor's own thread, not trio's worker threads: the kernel's parent-death signal
        (below) goes when the thread that started the process ends, and trio's threads come and go."""
        # the actor's import path, so that a --custom-reward module found here is found there too
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        # a process group of its own: what a reward starts (a sandboxed run of generated code) is killed with it
        process = subprocess.Popen([sys.executable, "-m", "vime.reward_workers"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env, start_new_session=True)
        with contextlib.suppress(BrokenPipeError):  # it died at once: waiting for its hello reports how it ended
            process.stdin.write(_frame(spec))  # a pipe's buffer holds it: nothing reads it before the process starts
            process.stdin.flush()
        return cls(process)

    async def _read(self, size: int) -> bytes:
        while len(self.pending) < size:
            chunk = await self.stdout.receive_some()
            if not chunk:  # its stdout closed: it has exited, or is about to
                raise _Died()
            self.pending += chunk
        data, self.pending = self.pending[:size], self.pending[size:]
        return data

    async def _reply(self, limit_s: float) -> Any:
        """The next frame from the process, or None if none came within ``limit_s``."""
        with trio.move_on_after(limit_s):
            size = int.from_bytes(await self._read(4), "big")
            return msgpack.unpackb(await self._read(size))
        return None

    async def call(self, request: bytes, limit_s: float) -> float | None:
        """The reward for ``request`` (a frame), or None when the call ran past ``limit_s`` (the process must
        then be stopped). BrokenResourceError: the process was gone before the request reached it."""
        if not self.ready:
            try:
                hello = await self._reply(START_S)
            except _Died:
                raise RuntimeError(f"a reward worker exited as it started (exit code {self.process.wait()}); "
                                   "see the reward actor's log for its traceback") from None
            if hello != "ready":
                problem = hello.get("error") if isinstance(hello, dict) else f"no answer in {START_S:.0f} s"
                raise RuntimeError(f"a reward worker could not start: {problem}")
            self.ready = True
        await self.stdin.send_all(request)
        answer = await self._reply(limit_s)
        if answer is None:
            return None
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["reward"]

    def stop(self) -> None:
        """Kill the process and whatever it started (it may be stuck in C code that no signal handler
        interrupts), and reap it."""
        for stream in (self.stdin, self.stdout):
            stream.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _frame(value: Any) -> bytes:
    body = msgpack.packb(value)
    return len(body).to_bytes(4, "big") + body


def _serve() -> None:
    """A worker's loop: read which function (its first frame), find it, say ready, then score each request until
    stdin closes. Frames go out on the stdout it was started with; what the function prints goes to stderr."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the actor's to handle; it stops us
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer

    def send(value: Any) -> None:
        out.write(_frame(value))
        out.flush()

    try:
        spec = msgpack.unpackb(inp.read(int.from_bytes(inp.read(4), "big")))
        fn = rewards.resolve(**spec)
        if fn is rewards.BUILT_IN.get(spec["name"]):  # it imports what it needs on its first call (sympy: seconds)
            fn("1", "1")
    except Exception as err:
        send({"error": f"{type(err).__name__}: {err}"})
        return
    send("ready")
    while len(head := inp.read(4)) == 4:
        body = inp.read(int.from_bytes(head, "big"))
        try:
            request = msgpack.unpackb(body)
            value = rewards.call(fn, request["response"], request["label"], request["metadata"], request["fields"])
            answer: dict[str, Any] = {"reward": rewards.checked(fn, value)}
        except Exception as err:
            answer = {"error": f"reward function failed: {type(err).__name__}: {err}"}
        send(answer)


def _die_with_parent() -> None:
    """On Linux, have the kernel kill this process when the actor that started it dies: a worker stuck in a
    call never reads its closed stdin, and would outlive a reward actor killed with kill -9."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the actor died before the line above
            sys.exit(0)


if __name__ == "__main__":
    _serve()
