"""The reward actor: scores every sample of a group and passes the group on.

The function is a built-in (``--reward NAME``) or the user's
(``--custom-reward module:function``), plain or async; see
``vime.rewards``. Async functions score a group's samples concurrently; a
plain function runs inline, so it should be cheap (rule-based checking) --
a slow one belongs behind an async call. A function that raises or returns
something other than a finite number stops the reward actor, and with it
the run, naming the error: a silent 0 reward would corrupt training, and a
group never scored would stall it.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import trio

from vime import rewards
from vime.config import RunConfig
from vime.messages.pipeline import RolloutGroup, ScoredGroup
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class Reward(Actor):
    role = "reward"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        run = RunConfig.from_dict(self.config)
        self.fn = rewards.resolve(run.reward.reward, run.reward.custom_reward)

    @handles(RolloutGroup)
    async def _on_group(self, msg: RolloutGroup, envelope: Envelope) -> None:
        started = time.perf_counter()

        async def score_one(sample: Any) -> None:
            if sample.reward is None:  # an external agent may have scored its episode itself
                sample.reward = await rewards.score(self.fn, sample.response_text, sample.label, sample.metadata)

        try:
            if inspect.iscoroutinefunction(self.fn):
                async with trio.open_nursery() as nursery:
                    for sample in msg.samples:
                        nursery.start_soon(score_one, sample)
            else:
                for sample in msg.samples:
                    await score_one(sample)
        except Exception as err:  # a reward that cannot score would stall the run: stop it, loudly
            self.log.exception("the reward function failed; stopping the run", group_id=msg.group_id)
            self.crash(RuntimeError(f"reward function failed on group {msg.group_id}: {err!r}"))
            return
        self.counters["scored_samples"] += len(msg.samples)
        await self.tell("buffer", ScoredGroup(group_id=msg.group_id, samples=msg.samples, worker=msg.worker,
                                              generate_s=msg.generate_s, reward_s=time.perf_counter() - started))
