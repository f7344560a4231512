"""The reward actor: scores every sample of a group and passes the group on.

The function is a built-in (``--reward NAME``) or the user's
(``--custom-reward module:function``), plain or async; see
``vime.rewards``. A group's samples are scored concurrently: a plain
function in ``--reward-workers`` processes, an async one here; each call
under ``--reward-timeout`` (``vime.reward_workers``), past which the sample
scores 0 and is counted (``reward_timeouts``), so a reward that hangs cannot
stall the run. A function that raises or returns something other than a
finite number stops the reward actor, and with it the run, naming the
error: a silent 0 reward would corrupt training.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from vime.config import RunConfig
from vime.messages.pipeline import RolloutGroup, ScoredGroup
from vime.reward_workers import RewardWorkers, WorkersClosed
from vime.runtime import Actor, ActorSettings, handles
from vime.transports.codec import Envelope


class Reward(Actor):
    role = "reward"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        run = RunConfig.from_dict(self.config)
        self.workers = RewardWorkers(run.reward.reward, run.reward.custom_reward, run.reward.reward_workers,
                                     run.reward.reward_timeout)

    async def on_start(self) -> None:
        self.workers.start()

    async def on_stop(self) -> None:
        self.workers.close()

    @handles(RolloutGroup)
    async def _on_group(self, msg: RolloutGroup, envelope: Envelope) -> None:
        started = time.perf_counter()
        timeouts = 0

        async def score_one(sample: Any) -> None:
            nonlocal timeouts
            if sample.reward is None:  # an external agent may have scored its episode itself
                scored = await self.workers.score(sample.response_text, sample.label, sample.metadata)
                sample.reward, timeouts = scored.reward, timeouts + scored.timed_out

        try:
            async with trio.open_nursery() as nursery:
                for sample in msg.samples:
                    nursery.start_soon(score_one, sample)
        except Exception as err:  # a reward that cannot score would stall the run: stop it, loudly
            if isinstance(err, BaseExceptionGroup) and err.split(WorkersClosed)[1] is None:
                self.log.info("stopping: a group was left unscored", group_id=msg.group_id)
                return
            self.log.exception("the reward function failed; stopping the run", group_id=msg.group_id)
            self.crash(RuntimeError(f"reward function failed on group {msg.group_id}: {err!r}"))
            return
        if timeouts:
            self.log.warning("reward calls cut off (past --reward-timeout, or their process died): scored 0",
                             group_id=msg.group_id, timeouts=timeouts)
        self.counters["scored_samples"] += len(msg.samples)
        self.counters["reward_timeouts"] += timeouts
        await self.tell("buffer", ScoredGroup(group_id=msg.group_id, samples=msg.samples, worker=msg.worker,
                                              generate_s=msg.generate_s, reward_s=time.perf_counter() - started,
                                              reward_timeouts=timeouts))
