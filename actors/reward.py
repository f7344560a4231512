"""The reward actor: scores every sample of a group and passes the group on.

The function is a built-in (``--reward NAME``) or the user's
(``--custom-reward module:function``, or slime's ``custom_rm(args, sample)``
as ``--custom-rm-path``), plain or async; see ``vime.rewards``. A group's
samples are scored concurrently, and several groups at once
(``GROUPS_IN_FLIGHT``), passed on in the order they came:
a plain function in ``--reward-workers`` processes, an async one here; each call
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
        self.workers = RewardWorkers.for_run(run)
        self.slots = trio.Semaphore(GROUPS_IN_FLIGHT)
        self.last_turn = trio.Event()  # set once the group that came last is sent on
        self.last_turn.set()

    async def on_start(self) -> None:
        self.workers.start()

    async def on_stop(self) -> None:
        self.workers.close()

    @handles(RolloutGroup)
    async def _on_group(self, msg: RolloutGroup, envelope: Envelope) -> None:
        """Start scoring the group beside the next ones (up to GROUPS_IN_FLIGHT; then this waits, and the inbox
        with it): one slow sample then holds one worker, not the actor. Groups go on in the order they came."""
        await self.slots.acquire()
        turn, self.last_turn = self.last_turn, trio.Event()
        self.start_soon(self._score_and_send, msg, turn, self.last_turn)

    async def _score_and_send(self, msg: RolloutGroup, turn: trio.Event, done: trio.Event) -> None:
        try:
            scored = await self._score(msg)
            await turn.wait()
            if scored is not None:
                await self.tell("buffer", scored)
        finally:
            done.set()
            self.slots.release()

    async def _score(self, msg: RolloutGroup) -> ScoredGroup | None:
        """The group with every sample scored; None when it cannot be (the run stops: the actor crashed, or is
        stopping with this group unscored)."""
        started = time.perf_counter()
        timeouts = 0

        async def score_one(sample: Any) -> None:
            nonlocal timeouts
            if sample.reward is None:  # an external agent may have scored its episode itself
                scored = await self.workers.score(sample.response_text, sample.label, sample.metadata, sample)
                sample.reward, timeouts = scored.reward, timeouts + scored.timed_out

        try:
            async with trio.open_nursery() as nursery:
                for sample in msg.samples:
                    nursery.start_soon(score_one, sample)
        except Exception as err:  # a reward that cannot score would stall the run: stop it, loudly
            if isinstance(err, BaseExceptionGroup) and err.split(WorkersClosed)[1] is None:
                self.log.info("stopping: a group was left unscored", group_id=msg.group_id)
                return None
            self.log.exception("the reward function failed; stopping the run", group_id=msg.group_id)
            self.crash(RuntimeError(f"reward function failed on group {msg.group_id}: {err!r}"))
            return None
        if timeouts:
            self.log.warning("reward calls cut off (past --reward-timeout, or their process died): scored 0",
                             group_id=msg.group_id, timeouts=timeouts)
        self.counters["scored_samples"] += len(msg.samples)
        self.counters["reward_timeouts"] += timeouts
        return ScoredGroup(group_id=msg.group_id, samples=msg.samples, worker=msg.worker, generate_s=msg.generate_s,
                           finished_at=msg.finished_at, reward_s=time.perf_counter() - started,
                           reward_timeouts=timeouts)


# Groups scored at once. A pathological answer holds a worker for up to --reward-timeout (math-verify's own limit
# is 5 s); scored one group at a time, it held the whole actor, and 1 % of them cut rewards/s a hundredfold
# (bench/rewards.py). With several groups in flight the other workers go on with the next groups meanwhile.
GROUPS_IN_FLIGHT = 8
