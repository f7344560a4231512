"""The trainer: pulls batches, steps the policy, publishes new weights.

Its loop, once per step: ask the buffer for the step's batch (WantBatch) and
wait; train on it in a worker thread (the engine recomputes log-probs, takes
the algorithm's optimizer steps); send the new weights, version v+1, to
every rollout worker; tell the buffer the version is out; queue the step's
row for RUN_DIR/metrics.jsonl. A rollout worker that joins later gets the
latest published weights as soon as it asks WantWeights.

It registers, then builds its engine (a worker thread; its handlers wait): with several Megatron ranks it is
rank 0 and starts the others, on this host or through the node agents of the hosts the driver placed them on
(``vime.trainer_ranks``), whose news of a rank's exit and output it takes (ActorExited, LogLines).

It delegates each concern to its module:

* weight sync -- ``vime.weights``: the path of each worker (CUDA IPC, a
  broadcast group or nng chunks, chosen from the GPUs it names in
  WantWeights under ``--weight-sync``), every version sent, the fallback to
  nng. Names are the checkpoint's and the dtype the rollout's (``--dtype``).
* GPU turns -- ``vime.gpu_turns``: with ``--colocate``, training starts once
  the engines are built (EnginesStarted), an engine built later gets its turn
  between two steps (MayBuildEngine), and with vLLM's sleep mode the engines
  on our GPUs sleep through every step (SleepEngine); the weights wake them.
* rows -- ``vime.metrics``: a step's row waits (training goes on) for the
  ``eval/*`` metrics of its version when that version is evaluated
  (EvalResult); every eval result also goes to RUN_DIR/eval.jsonl.
* checkpoints -- ``vime.checkpoint``: every ``save_every`` steps a resumable
  checkpoint (ours and the buffer's state, asked for right after the version
  is published, written once the rows before it are, so a resumed run neither
  loses nor repeats a row); every ``save_hf_every`` steps RUN_DIR/hf/step_N,
  and after the last step RUN_DIR/checkpoint: Hugging Face folders, usable as
  ``--model-path``. Started with a checkpoint (``--resume``), it continues
  from there and sends the restored weights to every worker.

The row also has ``train_tflops_per_gpu`` (``vime.metrics``) and the trainer's memory once the step's version is
published, in MiB: ``trainer_rss_mib`` (host) and, on a GPU, ``trainer_gpu_allocated_mib`` (what torch holds on
rank 0's GPU): a leak per version is a line that climbs.

Time split per step (all in metrics.jsonl): ``time_wait_s`` waiting for the
batch (and for an engine being built on our GPU), ``time_collate_s`` making its
samples one padded batch of tensors, ``time_sleep_s`` waiting for
colocated engines to go to sleep, ``time_train_s``, ``time_weight_sync_s``
(waking them included), and of the sleep time ``time_drain_s``, the engines
finishing responses; the batch brings ``time_generate_s`` and
``time_reward_s`` from the rollout side.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import transformers
import trio

from vime import checkpoint
from vime.backends import train_engine
from vime.backends.base import collate_samples
from vime.backends.hf import load_tokenizer
from vime.config import ActorStart
from vime.gpu_turns import TrainerGpu
from vime.messages.gpu_turns import BuildTurn, EnginesStarted, MayBuildEngine
from vime.messages.nodes import ActorExited, LogLines
from vime.messages.pipeline import EvalResult, TrainBatch, WantBatch, WeightsPublished
from vime.metrics import StepRows, step_row, train_tflops_per_gpu, trainer_memory_mib
from vime.runtime import Actor, ActorSettings, PeerGone, handles
from vime.startup import timed
from vime.trainer_ranks import NodeRanks, RankPlan
from vime.transports.codec import Envelope
from vime.weights import WantWeights, WeightPath, WeightsComing, WeightSender


class Trainer(Actor):
    role = "trainer"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.started_with = ActorStart.from_dict(self.config)
        self.run = run = self.started_with.run
        if run.job.train_threads:
            torch.set_num_threads(run.job.train_threads)
        plan = self.config.get("rank_plan")  # where the driver placed the ranks after 0 (None: all on this host)
        self.rank_plan = None if plan is None else RankPlan.from_dict(plan)
        self.workers: set[str] = set()  # those sent every new version
        # Held while the weights change or travel: the training loop's publication and a joining worker's
        # first weights (a task of its own) must not interleave (see vime.tasks).
        self.weights_lock = trio.Lock()
        self.batches_in, self.batches = trio.open_memory_channel[TrainBatch](1)
        self.run_dir = Path(settings.run_dir or ".")
        self.tokenizer = load_tokenizer(run.model.model_path)
        self.model_config = transformers.AutoConfig.from_pretrained(run.model.model_path)  # for train_tflops_per_gpu
        self.pad_token_id = self.tokenizer.pad_token_id or 0  # what padding holds is masked out anyway
        self.first_step = 0
        self.ranks = NodeRanks(self)  # starts each rank after 0, here or through its node's agent

    async def on_start(self) -> None:
        """Build the engine once registered, in a worker thread: rank 0 starts the ranks the plan puts on other
        hosts through their node agents, which takes this actor's messages (the loop runs meanwhile; handlers
        wait until it is built)."""
        await trio.to_thread.run_sync(self._build_engine)
        self._attach_engine()
        self.start_soon(self._train_loop)
        self.start_soon(self.rows.write_loop)

    def build(self) -> None:
        """What :meth:`on_start` builds, at once, for a trainer driven outside a job (tests): all ranks here."""
        self._build_engine()
        self._attach_engine()

    def _build_engine(self) -> None:
        """Build the engine, then read the checkpoint when resuming, each timed for the start-up breakdown."""
        with timed(self.startup, "engine_build_s"):
            self.engine = train_engine(self.run, self.settings.seed, self.rank_plan, self.ranks)
        if self.started_with.resume_from is not None:
            with timed(self.startup, "checkpoint_read_s"):
                self.engine.load(self.started_with.resume_from)
            self.first_step = checkpoint.step_of(self.started_with.resume_from)
            self.log.info("resumed", checkpoint=str(self.started_with.resume_from), step=self.first_step,
                          weight_version=self.engine.weight_version)

    def _attach_engine(self) -> None:
        run = self.run
        self.rows = StepRows(self.run_dir, run.eval.versions(run.job.steps), written=self.first_step)
        self.version_out = self.engine.weight_version  # the newest version sent to the workers
        self.gpus = self.engine.gpus()  # those of every rank on this host
        self.weights = WeightSender(self, self.engine, run, self._forget)  # every worker's path
        self.gpu = TrainerGpu(self, self.engine, run, self._forget)  # build turns and sleep of the engines beside us
        self.saves = checkpoint.TrainerSaves(self, self.run_dir, run.job, self.engine, self.tokenizer, self.rows)

    def on_arrival(self, envelope: Envelope) -> bool:
        """A node agent's news of a trainer rank it runs for us, taken as it arrives: its exit (the engine stops
        on it) and its output (into this log). Handlers wait until the engine is built (:meth:`on_start`), and
        the build waits on every rank: a rank that dies as it starts must reach ``LeadingEngine``'s watch then,
        not after the group's 30-minute timeout."""
        payload = envelope.payload
        if type(payload) is ActorExited:
            self.ranks.exited(envelope.sender, payload)
        elif type(payload) is LogLines:
            self.ranks.output(envelope.sender, payload)
        else:
            return False
        return True

    async def on_stop(self) -> None:
        self.rows.close()
        await trio.to_thread.run_sync(self.engine.close)

    async def on_peer_gone(self, name: str) -> None:
        self.ranks.node_gone(name)  # a node agent that ran ranks of ours: they are gone with it
        self.gpu.built(name)
        self._forget(name)

    def _forget(self, worker: str) -> None:
        self.workers.discard(worker)
        self.gpu.drop(worker)
        self.weights.detach(worker)

    @handles(WantWeights)
    async def _on_worker(self, msg: WantWeights, envelope: Envelope) -> WeightsComing:
        """A worker (new, restarted or joined) gets the latest weights; the answer says which version.
        A path its placement does not allow is refused here, and the worker stops with the reason."""
        self.gpu.built(envelope.sender)
        path = self.weights.choose(self.gpus, msg.gpus)
        self.start_soon(self._bring_in, envelope.sender, path, msg.gpus, msg.weight_version)
        return WeightsComing(version=self.version_out)

    async def _bring_in(self, worker: str, path: type[WeightPath], gpus: list[str], version: int) -> None:
        """Set up the worker's path (a broadcast group meets here, outside the weights lock, so that training
        goes on meanwhile), send it the newest weights if it lacks them, and from then on every new version
        (and, when its engine shares our GPU, a SleepEngine before every step)."""
        self._forget(worker)
        try:
            served = await self.weights.attach(worker, path, gpus)
            self.log.info("weight path", worker=worker, path=served.name, gpus=gpus,
                          **({} if served is path else {"instead_of": path.name}))
            async with self.weights_lock:
                self.weights.serve(worker, served)
                if version < self.version_out:
                    await self.weights.publish([worker])
                    if not self.weights.serves(worker):  # gone meanwhile
                        return
                self.workers.add(worker)
                self.gpu.share(worker, gpus, self.gpus)
        except (PeerGone, LookupError):
            self._forget(worker)

    @handles(MayBuildEngine)
    async def _on_may_build(self, msg: MayBuildEngine, envelope: Envelope) -> BuildTurn:
        return self.gpu.may_build(envelope.sender, msg, weights_travel=self.weights_lock.locked())

    @handles(EnginesStarted)
    async def _on_engines_started(self, msg: EnginesStarted, envelope: Envelope) -> None:
        self.gpu.engines_started()

    @handles(EvalResult)
    async def _on_eval(self, msg: EvalResult, envelope: Envelope) -> None:
        self.rows.evaluated(msg.version, msg.metrics)
        self.log.info("evaluated", version=msg.version, pass_at_1=msg.metrics.get("eval/pass@1"))

    @handles(TrainBatch)
    async def _on_batch(self, msg: TrainBatch, envelope: Envelope) -> None:
        await self.batches_in.send(msg)

    async def _train_loop(self) -> None:
        await self.wait_for_peer("buffer", timeout=600.0)
        await self.gpu.first_turn()
        checkpoint_s = 0.0  # writing checkpoints since the row before: outside every step's own time
        for step in range(self.first_step, self.run.job.steps):
            self.gpu.release()  # until this step has its batch, an engine may be built on our GPU
            started = time.perf_counter()
            await self.tell("buffer", WantBatch(step=step))
            batch = await self.batches.receive()
            waited = time.perf_counter() - started
            samples = batch.samples
            collating = time.perf_counter()
            tensors = collate_samples(samples, self.pad_token_id)
            collated = time.perf_counter() - collating
            waited += await self.gpu.take()  # for an engine being built on our GPU
            async with self.weights_lock:
                slept = time.perf_counter()
                drained = await self.gpu.sleep_engines(self.workers, self.version_out)
                train_started = time.perf_counter()
                metrics = await trio.to_thread.run_sync(self.engine.train_step, tensors)
                if drained is not None:  # what training cached goes back to the engines about to wake
                    await trio.to_thread.run_sync(self.engine.release_memory)
                trained = time.perf_counter()
                weight_paths = await self._publish()
            synced = time.perf_counter()
            checkpoint_s += await self.saves.before_row(step)
            train_s = trained - train_started
            times = {"step_time_s": synced - started, "time_wait_s": waited, "time_collate_s": collated,
                     "time_sleep_s": train_started - slept, "time_drain_s": drained or 0.0, "time_train_s": train_s,
                     "time_weight_sync_s": synced - trained, "time_checkpoint_s": checkpoint_s}
            tflops = train_tflops_per_gpu(self.model_config, tensors, train_s,
                                          self.run.job.trainer_ranks if self.gpus else 1)
            row = step_row(step + 1, self.engine.weight_version, samples, tensors, times, tflops,
                           trainer_memory_mib(self.gpus), batch.stats, metrics, weight_paths)
            await self.rows.add(row)
            self.log.info("step", step=step + 1, weight_version=self.engine.weight_version,
                          raw_reward=round(row["raw_reward"], 4), loss=round(row["loss"], 5))
            checkpoint_s = await self.saves.after_row(step)

    async def _publish(self) -> dict[str, str]:
        """Weights of the new version to every worker, then the news to the buffer; the path that took them to
        each worker still served (a worker whose path failed got them over nng)."""
        await self.weights.publish(sorted(self.workers))  # none: nothing gathered, nothing converted
        self.version_out = self.engine.weight_version
        await self.tell("buffer", WeightsPublished(version=self.version_out))
        return {worker: self.weights.paths[worker].name for worker in sorted(self.workers)}
