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
"""

from __future__ import annotations

import collections
from typing import Any

from vime.messages.pipeline import GenerateGroup, GroupDone, WorkerLeaving, WorkerReady
from vime.messages.runtime import Status
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class Router(Actor):
    role = "router"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.capacity: dict[str, int] = {}  # worker -> groups it takes at once
        self.assigned: dict[str, set[int]] = {}  # worker -> group ids it is generating
        self.tokens: dict[str, int] = {}  # worker -> tokens of the groups it is generating
        self.requests: dict[int, GenerateGroup] = {}  # every group not yet done
        self.waiting: collections.deque[int] = collections.deque()

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
