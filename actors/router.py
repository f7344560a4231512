"""The router: spreads generation requests over the rollout workers by load.

Workers announce themselves (WorkerReady) with how many groups they take at
once; a request goes to the worker with the lowest share of its capacity in
use, or waits until one frees up. The router remembers every request until
its worker reports it done, and when a worker dies or leaves it re-issues
that worker's requests to the others (counted as ``reissued``) -- so a
killed worker loses no prompt. A WorkerReady under a name that still holds
requests is a restarted process: those requests are re-issued too, whichever
of the two news arrives first.
"""

from __future__ import annotations

import collections
from typing import Any

from vime.protocol import GenerateGroup, GroupDone, WorkerReady
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class Router(Actor):
    role = "router"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.capacity: dict[str, int] = {}  # worker -> groups it takes at once
        self.assigned: dict[str, set[int]] = {}  # worker -> group ids it is generating
        self.requests: dict[int, GenerateGroup] = {}  # every group not yet done
        self.waiting: collections.deque[int] = collections.deque()

    @handles(WorkerReady)
    async def _on_ready(self, msg: WorkerReady, envelope: Envelope) -> None:
        orphans = sorted(self.assigned.get(envelope.sender, ()))
        if orphans:  # a new process under a known name: the old one's groups died with it
            self.counters["reissued"] += len(orphans)
            self.waiting.extendleft(reversed(orphans))
        self.capacity[envelope.sender] = max(1, msg.capacity)
        self.assigned[envelope.sender] = set()
        self.log.info("rollout worker ready", worker=envelope.sender, capacity=msg.capacity)
        await self._assign()

    @handles(GenerateGroup)
    async def _on_request(self, msg: GenerateGroup, envelope: Envelope) -> None:
        self.requests[msg.group_id] = msg
        self.waiting.append(msg.group_id)
        await self._assign()

    @handles(GroupDone)
    async def _on_done(self, msg: GroupDone, envelope: Envelope) -> None:
        self.assigned.get(envelope.sender, set()).discard(msg.group_id)
        if self.requests.pop(msg.group_id, None) is not None:
            self.counters["done"] += 1
        await self._assign()

    async def on_peer_gone(self, name: str) -> None:
        if name not in self.capacity:
            return
        del self.capacity[name]
        orphans = sorted(self.assigned.pop(name, set()))
        self.log.warning("rollout worker gone; re-issuing its requests", worker=name, requests=len(orphans))
        self.counters["reissued"] += len(orphans)
        self.waiting.extendleft(reversed(orphans))
        await self._assign()

    async def _assign(self) -> None:
        while self.waiting and self.capacity:
            worker = min(self.capacity, key=lambda w: (len(self.assigned[w]) / self.capacity[w], w))
            if len(self.assigned[worker]) >= self.capacity[worker]:
                return
            group_id = self.waiting.popleft()
            self.assigned[worker].add(group_id)
            self.counters["dispatched"] += 1
            await self.tell(worker, self.requests[group_id])
