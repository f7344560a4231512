"""The router: spreads generation requests over the rollout workers by load.

Workers announce themselves (WorkerReady) with how many groups they take at
once. A request goes to the worker with the fewest tokens in flight per
unit of capacity (a group counts ``group_size x (prompt + max_new_tokens)``
tokens: long prompts and long answers weigh more than short ones), or waits
until a worker has room. The router remembers every request until its
worker reports it done, and re-issues a worker's requests to the others
(counted as ``reissued``) when it dies, leaves (WorkerLeaving, after
SIGTERM), or comes back as a new process under the same name -- so a
worker that goes away loses no prompt.

Resuming: the router keeps its counters and the ids of the groups it holds
(requested, not yet done) current in RUN_DIR/checkpoints/router.json: at
every re-issue, and every ``STATE_EVERY_S`` seconds. A router started for a
resumed run (``--resume``) takes the counters back -- a summary goes on
counting the re-issues before the crash -- and counts the groups held at the
crash (``held_at_crash``). Those are not lost: the resumed buffer issues
every one of them again, from its checkpoint's groups in flight or, for
those issued after it, from its data cursor, under the same ids.
"""

from __future__ import annotations

import collections
from typing import Any

import trio

from vime import checkpoint
from vime.config import ActorStart
from vime.messages.pipeline import GenerateGroup, GroupDone, WorkerLeaving, WorkerReady
from vime.messages.runtime import Status
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope

STATE_EVERY_S = 1.0  # a kill -9 loses at most this much of the counters' news (re-issues: none)


class Router(Actor):
    role = "router"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.capacity: dict[str, int] = {}  # worker -> groups it takes at once
        self.assigned: dict[str, set[int]] = {}  # worker -> group ids it is generating
        self.tokens: dict[str, int] = {}  # worker -> tokens of the groups it is generating
        self.requests: dict[int, GenerateGroup] = {}  # every group not yet done
        self.waiting: collections.deque[int] = collections.deque()
        self.resume_from = ActorStart.from_dict(self.config).resume_from
        self.state_path = checkpoint.folder(settings.run_dir) / "router.json" if settings.run_dir else None

    async def on_start(self) -> None:
        if self.state_path is None:  # not part of a run (a test's router)
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        if self.resume_from is not None:
            self._restore()
        self.start_soon(self._keep_state)

    async def on_stop(self) -> None:
        self._save_state()

    def _restore(self) -> None:
        """Take back the counters of the run's earlier router, and count the groups it held when it stopped."""
        saved = checkpoint.read_json(self.state_path)
        if saved is None:
            self.log.warning("resumed without the earlier router's state; its counters start at 0",
                             path=str(self.state_path))
            return
        self.counters.update(saved["counters"])
        self.counters["held_at_crash"] += len(saved["held"])
        self.log.info("resumed", reissued=self.counters["reissued"], held_at_crash=len(saved["held"]))

    async def _keep_state(self) -> None:
        while True:
            self._save_state()
            await trio.sleep(STATE_EVERY_S)

    def _save_state(self) -> None:
        if self.state_path is not None:
            checkpoint.write_json(self.state_path, {"counters": dict(self.counters), "held": sorted(self.requests)})

    def status(self) -> Status:
        status = super().status()
        status.counters.update({f"assigned:{worker}": len(groups) for worker, groups in self.assigned.items()},
                               waiting=len(self.waiting))
        return status

    @handles(WorkerReady)
    async def _on_ready(self, msg: WorkerReady, envelope: Envelope) -> None:
        self._reissue(envelope.sender, "restarted")  # a new process under a known name: the old one's groups died
        self.capacity[envelope.sender] = max(1, msg.capacity)
        self.assigned[envelope.sender] = set()
        self.tokens[envelope.sender] = 0
        self.log.info("rollout worker ready", worker=envelope.sender, capacity=msg.capacity,
                      weight_version=msg.weight_version)
        await self._assign()

    @handles(GenerateGroup)
    async def _on_request(self, msg: GenerateGroup, envelope: Envelope) -> None:
        self.requests[msg.group_id] = msg
        self.waiting.append(msg.group_id)
        await self._assign()

    @handles(GroupDone)
    async def _on_done(self, msg: GroupDone, envelope: Envelope) -> None:
        if msg.group_id not in self.assigned.get(envelope.sender, ()):
            # From a worker that was given up on (it died or left) after it finished: the group
            # was re-issued already, and the buffer counts the second copy as a duplicate.
            self.counters["late_done"] += 1
            return
        self.assigned[envelope.sender].discard(msg.group_id)
        self.tokens[envelope.sender] -= _tokens(self.requests.pop(msg.group_id))
        self.counters["done"] += 1
        await self._assign()

    @handles(WorkerLeaving)
    async def _on_leaving(self, msg: WorkerLeaving, envelope: Envelope) -> None:
        self._reissue(envelope.sender, "left")
        await self._assign()

    async def on_peer_gone(self, name: str) -> None:
        self._reissue(name, "gone")
        await self._assign()

    def _reissue(self, worker: str, why: str) -> None:
        """Forget ``worker``'s assignments and put its unfinished groups first in line."""
        orphans = sorted(self.assigned.pop(worker, set()))
        self.capacity.pop(worker, None)
        self.tokens.pop(worker, None)
        if orphans:
            self.log.warning("re-issuing a rollout worker's groups", worker=worker, why=why, groups=len(orphans))
            self.counters["reissued"] += len(orphans)
            self.waiting.extendleft(reversed(orphans))
            self._save_state()

    async def _assign(self) -> None:
        while self.waiting:
            open_workers = [w for w in self.capacity if len(self.assigned[w]) < self.capacity[w]]
            if not open_workers:
                return
            worker = min(open_workers, key=lambda w: (self.tokens[w] / self.capacity[w], w))
            group_id = self.waiting.popleft()
            request = self.requests[group_id]
            self.assigned[worker].add(group_id)
            self.tokens[worker] += _tokens(request)
            self.counters["dispatched"] += 1
            self.counters[f"dispatched_to:{worker}"] += 1
            await self.tell(worker, request)


def _tokens(request: GenerateGroup) -> int:
    """What a group costs its worker, at most: every sample's prompt and longest answer."""
    return request.group_size * (len(request.prompt_ids) + int(request.sampling.get("max_new_tokens", 0)))
