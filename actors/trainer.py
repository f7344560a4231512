"""The trainer: pulls batches, steps the policy, publishes new weights.

Its loop, once per step: ask the buffer for the step's batch (WantBatch) and
wait; train on it in a worker thread (the engine recomputes log-probs, takes
the algorithm's optimizer steps); send the new weights, version v+1, to
every rollout worker in chunks; tell the buffer the version is out; append
the step's metrics to RUN_DIR/metrics.jsonl. A rollout worker that joins
later gets the latest published weights as soon as it says WorkerReady.
After the last step the policy is saved to RUN_DIR/checkpoint, and every
``save_hf_every`` steps to RUN_DIR/hf/step_N: Hugging Face folders, usable
as ``--model-path``.

Every ``save_every`` steps it writes a resumable checkpoint (``vime.checkpoint``):
its own state and the buffer's, asked for right after the version is
published -- so the two agree on which groups were trained. Started with a
checkpoint (``--resume``), it continues from there and sends the restored
weights to every worker that says WorkerReady.

With evaluation on, a step's row waits (in a writer task; training goes on)
for the ``eval/*`` metrics of the version the step produced when that version
is evaluated, so metrics.jsonl holds them beside the step's own; every eval
result, version 0's included, is also appended to RUN_DIR/eval.jsonl as it
arrives. A checkpoint is written only once the rows before it are, so a
resumed run neither loses nor repeats a row.

Time split per step (all in metrics.jsonl): ``time_wait_s`` waiting for the
batch, ``time_train_s``, ``time_weight_sync_s``; the batch brings
``time_generate_s`` and ``time_reward_s`` from the rollout side.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import trio

from vime import checkpoint
from vime.backends.base import TrainEngine, collate
from vime.backends.hf import load_tokenizer
from vime.backends.torch_train import TorchTrainEngine
from vime.config import RunConfig
from vime.metrics import MetricsWriter
from vime.protocol import (
    EvalResult,
    SnapshotQuery,
    TrainBatch,
    WantBatch,
    WeightsChunk,
    WeightsPublished,
    WorkerReady,
)
from vime.runtime import Actor, ActorSettings, PeerGone, handles
from vime.transports.codec import Envelope


class Trainer(Actor):
    role = "trainer"

    def __init__(self, settings: ActorSettings, config: dict[str, Any] | None = None) -> None:
        super().__init__(settings, config)
        self.run = RunConfig.from_dict(self.config)
        run = self.run
        if run.job.train_threads:
            torch.set_num_threads(run.job.train_threads)
        self.engine = train_engine(run.job.train_backend)(
            run.model.model_path, algo=run.job.algo, optim=run.optim, loss=run.loss, grpo_config=run.grpo,
            ppo_config=run.ppo, temperature=run.sampling.temperature, dtype=run.model.dtype,
            total_steps=run.job.steps, seed=settings.seed)
        self.workers: set[str] = set()
        self.published: list[WeightsChunk] = []  # a copy of the latest version, for workers that join later
        self.batches_in, self.batches = trio.open_memory_channel[TrainBatch](1)
        self.run_dir = Path(settings.run_dir or ".")
        self.tokenizer = load_tokenizer(run.model.model_path)
        self.pad_token_id = self.tokenizer.pad_token_id or 0  # what padding holds is masked out anyway
        self.metrics = MetricsWriter(self.run_dir)
        self.rows_in, self.rows = trio.open_memory_channel[dict[str, Any]](math.inf)
        self.eval_versions = set(run.eval.versions(run.job.steps))
        self.eval_results: dict[int, dict[str, float]] = {}
        self.first_step = 0
        self.rows_written = 0  # steps whose row is in metrics.jsonl
        self._changed = trio.Event()  # set (and replaced) when a row is written or an eval result arrives
        resume = self.config.get("checkpoint")
        if resume:
            self.engine.load(Path(resume))
            self.first_step = checkpoint.step_of(Path(resume))
            self.published = self._weight_chunks()
            self.rows_written = self.first_step
            self.log.info("resumed", checkpoint=resume, step=self.first_step, weight_version=self.engine.weight_version)

    async def on_start(self) -> None:
        self.start_soon(self._train_loop)
        self.start_soon(self._write_rows)

    async def on_stop(self) -> None:
        self.metrics.close()

    async def on_peer_gone(self, name: str) -> None:
        self.workers.discard(name)

    @handles(WorkerReady)
    async def _on_worker(self, msg: WorkerReady, envelope: Envelope) -> WeightsPublished:
        """A worker (new, restarted or joined) gets the latest weights; the answer says which version."""
        self.workers.add(envelope.sender)
        if not self.published:
            return WeightsPublished(version=msg.weight_version)
        if msg.weight_version < self.published[0].version:
            await self._send_weights(envelope.sender, self.published)
        return WeightsPublished(version=self.published[0].version)

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
        for step in range(self.first_step, self.run.job.steps):
            started = time.perf_counter()
            await self.tell("buffer", WantBatch(step=step))
            batch = await self.batches.receive()
            waited = time.perf_counter() - started
            samples = batch.samples
            tensors = collate([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                              [s.logprobs for s in samples], [s.versions for s in samples],
                              [s.reward for s in samples], [s.group_id for s in samples], self.pad_token_id,
                              [s.routed_experts for s in samples])
            train_started = time.perf_counter()
            metrics = await trio.to_thread.run_sync(self.engine.train_step, tensors)
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
                "time_train_s": trained - train_started,
                "time_weight_sync_s": synced - trained,
                "time_checkpoint_s": time.perf_counter() - synced,
                "group_ids": sorted({s.group_id for s in samples}),
                **batch.stats,
                **metrics,
            }
            if step + 1 == self.run.job.steps:  # before the last row: whoever sees it finds the checkpoint
                await trio.to_thread.run_sync(self._export, self.run_dir / "checkpoint")
            await self.rows_in.send(row)
            self.log.info("step", step=step, weight_version=self.engine.weight_version,
                          raw_reward=round(row["raw_reward"], 4), loss=round(row["loss"], 5))

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

    def _weight_chunks(self) -> list[WeightsChunk]:
        """A copy of the current weights cut into chunks of about ``weight_chunk_mb`` each.

        A copy, because a worker that joins mid-step is sent these while the
        optimizer is writing the live parameters in another thread.
        """
        limit = self.run.job.weight_chunk_mb << 20
        parts: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in self.engine.named_weights().items():
            if parts[-1] and size + tensor.nbytes > limit:
                parts.append({})
                size = 0
            parts[-1][name] = tensor.clone()
            size += tensor.nbytes
        version = self.engine.weight_version
        return [WeightsChunk(version=version, index=i, count=len(parts), tensors=p) for i, p in enumerate(parts)]

    async def _send_weights(self, worker: str, chunks: list[WeightsChunk]) -> None:
        try:
            for chunk in chunks:
                await self.tell(worker, chunk, weight_version=chunk.version)
        except (PeerGone, LookupError):
            self.workers.discard(worker)

    async def _publish(self) -> None:
        """Weights of the new version to every worker, then the news to the buffer."""
        self.published = chunks = self._weight_chunks()
        for worker in sorted(self.workers):
            await self._send_weights(worker, chunks)
        await self.tell("buffer", WeightsPublished(version=self.engine.weight_version))


def train_engine(backend: str) -> type[TrainEngine]:
    """The trainer engine class of ``--train-backend``; megatron-core is imported only when asked for."""
    if backend == "megatron":
        from vime.backends.megatron import MegatronTrainEngine

        return MegatronTrainEngine
    return TorchTrainEngine


def _plain(value: Any) -> Any:
    """JSON-safe: NaN/inf become None so that metrics.jsonl stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
