"""The trainer: pulls batches, steps the policy, publishes new weights.

Its loop, once per step: ask the buffer for the step's batch (WantBatch) and
wait; train on it in a worker thread (the engine recomputes log-probs, takes
the algorithm's optimizer steps); send the new weights, version v+1, to
every rollout worker; tell the buffer the version is out; append
the step's metrics to RUN_DIR/metrics.jsonl. A rollout worker that joins
later gets the latest published weights as soon as it asks WantWeights.

Weights travel by the path the worker's placement allows (``--weight-sync
auto``), chosen when it asks WantWeights from the GPUs it names: CUDA IPC,
a broadcast group or nng chunks; ``vime.weights`` holds the paths, their
choice and the fallback to nng, and the trainer hands every version to its
:class:`~vime.weights.WeightSender`. Names are the checkpoint's and the
dtype the rollout's (``--dtype``).
After the last step the policy is saved to RUN_DIR/checkpoint, and every
``save_hf_every`` steps to RUN_DIR/hf/step_N: Hugging Face folders, usable
as ``--model-path``.

Every ``save_every`` steps it writes a resumable checkpoint (``vime.checkpoint``):
its own state and the buffer's, asked for right after the version is
published -- so the two agree on which groups were trained. Started with a
checkpoint (``--resume``), it continues from there and sends the restored
weights to every worker that asks WantWeights.

With evaluation on, a step's row waits (in a writer task; training goes on)
for the ``eval/*`` metrics of the version the step produced when that version
is evaluated, so metrics.jsonl holds them beside the step's own; every eval
result, version 0's included, is also appended to RUN_DIR/eval.jsonl as it
arrives. A checkpoint is written only once the rows before it are, so a
resumed run neither loses nor repeats a row.

With vLLM's sleep mode on (``--vllm-enable-sleep-mode true``), the engines
on the trainer's own GPUs sleep through every training step: asked before it,
each finishes its running responses, starts no new ones and gives its GPU
memory back; the CUDA IPC weights after it wake them. Rollout and training
then take turns on the GPU, each with all of its memory. With ``--colocate``
the first step waits until the driver says every engine it starts is built
(EnginesStarted), so that no engine profiles its memory beside a training step;
an engine built later (a restarted worker) asks for its turn (MayBuildEngine)
and gets it between two steps, the next of which waits until it is built.

The row also has ``train_tflops_per_gpu``: the model FLOPs of the step's training (``vime.flops``) over its
time, per trainer GPU (per process on CPU); over a GPU's bf16 matmul peak, the train phase's MFU. And the
trainer's memory once the step's version is published, in MiB: ``trainer_rss_mib`` (host) and, on a GPU,
``trainer_gpu_allocated_mib`` (what torch holds on rank 0's GPU): a leak per version is a line that climbs.

Time split per step (all in metrics.jsonl): ``time_wait_s`` waiting for the
batch (and for an engine being built on our GPU), ``time_sleep_s`` waiting for
colocated engines to go to sleep, ``time_train_s``, ``time_weight_sync_s``
(waking them included), and of the sleep time ``time_drain_s``, the engines
finishing responses; the batch brings ``time_generate_s`` and
``time_reward_s`` from the rollout side.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
import trio

from vime import checkpoint
from vime.backends.base import TrainEngine, collate
from vime.backends.hf import load_tokenizer
from vime.backends.torch_train import TorchTrainEngine
from vime.config import RunConfig
from vime.flops import training_flops
from vime.messages.gpu_turns import (
    BUILD_TURN_KEPT_S,
    ENGINE_BUILD_S,
    BuildTurn,
    EnginesStarted,
    MayBuildEngine,
    SleepEngine,
)
from vime.messages.pipeline import EvalResult, SnapshotQuery, TrainBatch, WantBatch, WeightsPublished
from vime.metrics import MetricsWriter
from vime.placement import visible_gpus
from vime.runtime import Actor, ActorSettings, PeerGone, RemoteError, handles
from vime.transports.codec import Envelope
from vime.weights import WantWeights, WeightPath, WeightsComing, WeightSender


class Trainer(Actor):
    role = "trainer"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.run = RunConfig.from_dict(self.config)
        run = self.run
        if run.job.train_threads:
            torch.set_num_threads(run.job.train_threads)
        self.engine = train_engine(run, settings.seed)
        self.workers: set[str] = set()  # those sent every new version
        self.sharing_gpu: set[str] = set()  # workers whose engine is on our GPU (colocated): put to sleep
        self.weights_lock = trio.Lock()  # held while the weights change or travel
        self.batches_in, self.batches = trio.open_memory_channel[TrainBatch](1)
        self.run_dir = Path(settings.run_dir or ".")
        self.tokenizer = load_tokenizer(run.model.model_path)
        self.model_config = transformers.AutoConfig.from_pretrained(run.model.model_path)  # for train_tflops_per_gpu
        self.pad_token_id = self.tokenizer.pad_token_id or 0  # what padding holds is masked out anyway
        self.metrics = MetricsWriter(self.run_dir)
        self.rows_in, self.rows = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.eval_versions = set(run.eval.versions(run.job.steps))
        self.eval_results: dict[int, dict[str, float]] = {}
        self.first_step = 0
        self.engines_started = trio.Event()
        self.gpu_busy = False  # a step trains, publishes, saves or exports: no engine may start building here
        self.builds: dict[str, float] = {}  # workers building an engine on our GPU -> when we stop waiting
        self.queued: dict[str, float] = {}  # workers refused a turn to build -> when we stop keeping their place
        self.host, self.visible = os.uname().nodename, set(visible_gpus())
        self.rows_written = 0  # steps whose row is in metrics.jsonl
        self._changed = trio.Event()  # set (and replaced) when a row is written or an eval result arrives
        resume = self.config.get("checkpoint")
        if resume:
            self.engine.load(Path(resume))
            self.first_step = checkpoint.step_of(Path(resume))
            self.rows_written = self.first_step
            self.log.info("resumed", checkpoint=resume, step=self.first_step, weight_version=self.engine.weight_version)
        self.version_out = self.engine.weight_version  # the newest version sent to the workers
        self.gpus = self.engine.gpus()  # every rank's
        self.weights = WeightSender(self, self.engine, run, self._forget)  # every worker's path

    async def on_start(self) -> None:
        self.start_soon(self._train_loop)
        self.start_soon(self._write_rows)

    async def on_stop(self) -> None:
        self.metrics.close()
        await trio.to_thread.run_sync(self.engine.close)

    async def on_peer_gone(self, name: str) -> None:
        self._built(name)
        self._forget(name)

    def _forget(self, worker: str) -> None:
        self.workers.discard(worker)
        self.sharing_gpu.discard(worker)
        self.weights.detach(worker)

    @handles(WantWeights)
    async def _on_worker(self, msg: WantWeights, envelope: Envelope) -> WeightsComing:
        """A worker (new, restarted or joined) gets the latest weights; the answer says which version.
        A path its placement does not allow is refused here, and the worker stops with the reason."""
        self._built(envelope.sender)
        path = self.weights.choose(self.gpus, msg.gpus)
        self.log.info("weight path", worker=envelope.sender, path=path.name, gpus=msg.gpus)
        self.start_soon(self._bring_in, envelope.sender, path, msg.gpus, msg.weight_version)
        return WeightsComing(version=self.version_out)

    async def _bring_in(self, worker: str, path: type[WeightPath], gpus: list[str], version: int) -> None:
        """Set up the worker's path (a broadcast group meets here, outside the weights lock, so that training
        goes on meanwhile), send it the newest weights if it lacks them, and from then on every new version
        (and, when its engine shares our GPU, a SleepEngine before every step)."""
        self._forget(worker)
        try:
            path = await self.weights.attach(worker, path, gpus)
            async with self.weights_lock:
                self.weights.serve(worker, path)
                if version < self.version_out:
                    await self.weights.publish([worker])
                    if not self.weights.serves(worker):  # gone meanwhile
                        return
                self.workers.add(worker)
                if set(gpus) & set(self.gpus):
                    self.sharing_gpu.add(worker)
        except (PeerGone, LookupError):
            self._forget(worker)

    @handles(MayBuildEngine)
    async def _on_may_build(self, msg: MayBuildEngine, envelope: Envelope) -> BuildTurn:
        """Let a worker build its engine on our GPU only while no step uses the GPU, no weights are being handed
        over and no other engine is being built (two profiling at once would each count the other's memory);
        refused, it keeps its place, so that the next step waits for it instead of leaving it no moment
        between steps to start in."""
        worker = envelope.sender
        if msg.host != self.host or not self.visible & set(msg.gpus):
            return BuildTurn(granted=True)
        now = trio.current_time()
        if self.gpu_busy or self.weights_lock.locked() or set(self.builds) - {worker}:
            self.queued[worker] = now + BUILD_TURN_KEPT_S
            return BuildTurn(granted=False)
        self.queued.pop(worker, None)
        self.builds[worker] = now + ENGINE_BUILD_S
        self.engine.release_memory()  # what the last step cached is free memory to the engine's profile
        self.log.info("an engine is built on our GPU: training waits for it", worker=worker)
        return BuildTurn(granted=True)

    def _built(self, worker: str) -> None:
        """``worker`` no longer holds back training: its engine is built (WantWeights), or it is gone."""
        if (self.builds.pop(worker, None), self.queued.pop(worker, None)) != (None, None):
            self._notify()

    async def _take_the_gpu(self) -> None:
        """Wait until no engine is being built on our GPU or waits for its turn to be, then keep the GPU until
        the step is over; a worker silent past its deadline is given up on (the driver reports a dead one)."""
        while True:
            now = trio.current_time()
            for waiting in (self.builds, self.queued):
                for worker, deadline in list(waiting.items()):
                    if deadline < now:
                        self.log.warning("an engine took too long to build: training beside it", worker=worker)
                        del waiting[worker]
            if not (self.builds or self.queued):
                break
            with trio.move_on_after(1.0):
                await self._changed.wait()
        self.gpu_busy = True

    @handles(EnginesStarted)
    async def _on_engines_started(self, msg: EnginesStarted, envelope: Envelope) -> None:
        self.engines_started.set()

    @handles(EvalResult)
    async def _on_eval(self, msg: EvalResult, envelope: Envelope) -> None:
        self.eval_results[msg.version] = msg.metrics
        with (self.run_dir / "eval.jsonl").open("a") as file:
            file.write(json.dumps({"weight_version": msg.version, **msg.metrics}) + "\n")
        self.log.info("evaluated", version=msg.version, pass_at_1=msg.metrics.get("eval/pass@1"))
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    async def _write_rows(self) -> None:
        """Append each step's row in order, with its version's eval metrics when that version is evaluated."""
        async for row in self.rows:
            version = row["weight_version"]
            if version in self.eval_versions:
                await self._until(lambda: version in self.eval_results)
                row.update(self.eval_results[version])
            self.metrics.write({k: _plain(v) for k, v in row.items()})
            self.rows_written = row["step"] + 1
            self._notify()

    @handles(TrainBatch)
    async def _on_batch(self, msg: TrainBatch, envelope: Envelope) -> None:
        await self.batches_in.send(msg)

    async def _train_loop(self) -> None:
        await self.wait_for_peer("buffer", timeout=600.0)
        if self.run.placement.colocate and not self.engines_started.is_set():
            self.log.info("training waits for the engines on this GPU to be built")
            await self.engines_started.wait()
        for step in range(self.first_step, self.run.job.steps):
            self.gpu_busy = False  # until this step has its batch, an engine may be built on our GPU
            started = time.perf_counter()
            await self.tell("buffer", WantBatch(step=step))
            batch = await self.batches.receive()
            waited = time.perf_counter() - started
            samples = batch.samples
            tensors = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                              [s.logprobs for s in samples], [s.versions for s in samples],
                              [s.reward for s in samples], [s.group_id for s in samples], self.pad_token_id,
                              [s.routed_experts for s in samples], [s.loss_mask for s in samples])
            held = time.perf_counter()
            await self._take_the_gpu()
            waited += time.perf_counter() - held  # for an engine being built on our GPU
            async with self.weights_lock:
                slept = time.perf_counter()
                drained = await self._put_engines_to_sleep()
                train_started = time.perf_counter()
                metrics = await trio.to_thread.run_sync(self.engine.train_step, tensors)
                if drained is not None:  # what training cached goes back to the engines about to wake
                    await trio.to_thread.run_sync(self.engine.release_memory)
                trained = time.perf_counter()
                await self._publish()
            synced = time.perf_counter()
            every = self.run.job.save_every
            if every and (step + 1) % every == 0 and step + 1 < self.run.job.steps:
                version = self.engine.weight_version
                await self._until(lambda: self.rows_written == step and (
                    version not in self.eval_versions or version in self.eval_results))
                await self._save(step + 1)
            every = self.run.job.save_hf_every
            if every and (step + 1) % every == 0:
                await trio.to_thread.run_sync(self._export, self.run_dir / "hf" / f"step_{step + 1}")
            response_tokens = int(tensors.response_mask.sum())
            row = {
                "step": step,
                "weight_version": self.engine.weight_version,
                "raw_reward": statistics.fmean(s.reward for s in samples),
                "samples": len(samples),
                "response_tokens": response_tokens,
                "step_time_s": synced - started,
                "rollout_tokens_per_s": response_tokens / max(batch.stats["time_generate_s"], 1e-9),
                "time_wait_s": waited,
                "time_sleep_s": train_started - slept,
                "time_drain_s": drained or 0.0,
                "time_train_s": trained - train_started,
                "train_tflops_per_gpu": training_flops(self.model_config, tensors.attention_mask.sum(1).tolist())
                / max(trained - train_started, 1e-9) / 1e12 / max(len(self.gpus), 1),
                "time_weight_sync_s": synced - trained,
                "time_checkpoint_s": time.perf_counter() - synced,
                "group_ids": sorted({s.group_id for s in samples}),
                **_memory_mib(self.gpus),
                **batch.stats,
                **metrics,
            }
            if step + 1 == self.run.job.steps:  # before the last row: whoever sees it finds the checkpoint
                await trio.to_thread.run_sync(self._export, self.run_dir / "checkpoint")
            await self.rows_in.send(row)
            self.log.info("step", step=step, weight_version=self.engine.weight_version,
                          raw_reward=round(row["raw_reward"], 4), loss=round(row["loss"], 5))

    async def _put_engines_to_sleep(self) -> float | None:
        """With vLLM's sleep mode, the engines on our GPU finish their running responses and give their memory
        back while we train (the weights published next wake them). Returns the longest time an engine took
        to finish its responses, or None when none sleeps. One that cannot sleep stays awake, with a warning:
        training may then run short of memory."""
        sleepers = sorted(self.workers & self.sharing_gpu)
        if not (sleepers and self.run.rollout.vllm_args.get("enable_sleep_mode")):
            return None
        drains = [0.0]

        async def put_to_sleep(worker: str) -> None:
            try:
                answer = await self.ask(worker, SleepEngine(level=2, version=self.version_out), timeout=600.0)
                drains.append(answer.drain_s)
            except (PeerGone, LookupError):
                self._forget(worker)
            except (RemoteError, TimeoutError) as err:
                self.log.warning("a colocated engine did not go to sleep: training beside it (if memory runs out, "
                                 "lower --vllm-gpu-memory-utilization)", worker=worker, error=str(err))

        async with trio.open_nursery() as nursery:
            for worker in sleepers:
                nursery.start_soon(put_to_sleep, worker)
        return max(drains)

    async def _save(self, step: int) -> None:
        """A resumable checkpoint after ``step`` steps: ours and the buffer's state, atomically."""
        state = await self.ask("buffer", SnapshotQuery(step=step), timeout=600.0)

        def write(folder: Path) -> None:
            self.engine.save(folder)
            self.tokenizer.save_pretrained(folder / "model")
            checkpoint.write_record(folder / "buffer.vmsg", state)

        path = await trio.to_thread.run_sync(checkpoint.save, self.run_dir, step, write)
        self.log.info("checkpoint written", path=str(path), step=step, groups_in_flight=len(state.in_flight))

    def _export(self, folder: Path) -> None:
        """The policy and its tokenizer as a Hugging Face folder (loadable as --model-path), written whole."""
        checkpoint.write_folder(folder, self._write_hf)
        self.log.info("model exported", path=str(folder), weight_version=self.engine.weight_version)

    def _write_hf(self, folder: Path) -> None:
        self.engine.save_hf(folder)
        self.tokenizer.save_pretrained(folder)

    async def _publish(self) -> None:
        """Weights of the new version to every worker, then the news to the buffer."""
        await self.weights.publish(sorted(self.workers))  # none: nothing gathered, nothing converted
        self.version_out = self.engine.weight_version
        await self.tell("buffer", WeightsPublished(version=self.version_out))


def train_engine(run: RunConfig, seed: int) -> TrainEngine:
    """The trainer engine of ``--train-backend``; megatron-core is imported only when asked for. With
    several ranks (tensor x data parallel) this process is rank 0 and starts the others."""
    arguments = run.train_engine_arguments(seed)
    if run.job.train_backend != "megatron":
        return TorchTrainEngine(**arguments)
    if run.job.trainer_ranks > 1:
        from vime.backends.tensor_parallel import LeadingEngine

        return LeadingEngine(run, seed)
    from vime.backends.megatron import MegatronTrainEngine

    return MegatronTrainEngine(**arguments)


def _plain(value: Any) -> Any:
    """JSON-safe: NaN/inf become None so that metrics.jsonl stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _memory_mib(gpus: list[str]) -> dict[str, float]:
    """This process's resident host memory and, when it trains on GPUs, what torch has allocated on its own."""
    memory = {}
    with contextlib.suppress(OSError):  # /proc is Linux's
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        memory["trainer_rss_mib"] = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    if gpus:
        memory["trainer_gpu_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
    return memory
