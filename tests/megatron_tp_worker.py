"""Megatron trainers of several ranks for tests/test_megatron.py, each rank run by :func:`run` (forked by
``forked_ranks.run_ranks`` as torchrun would start it, or under torchrun itself). The modes: one rank of a
tensor, expert and data parallel trainer (the default); a leader that starts its own follower and loses it
(``lose-a-follower``, ``lose-a-starting-follower``); two ranks passing a batch as the leader orders a step
(``relay-a-batch``); three ranks offering weight buckets (``share-buckets``); a leader that orders its follower
to release memory, then to gather (``lead-and-release``); PPO's policy and value model trained by such ranks, in
pipeline stages too (``ppo``); the plain and the distributed optimizer side by side (``distributed-optimizer``);
padded rows and packed ones side by side (``packed``); one side of a checkpoint saved in one layout and resumed
in another (``layouts``); pipeline stages training over two steps (``pipeline``); and ranks that fail or hang on
purpose, for the tests of ``forked_ranks`` (``stall``).

Every rank builds the engine from the same Hugging Face folder and makes the
same calls with the same batch (read from a file the test wrote; the other
ranks join rank 0's weight gathers as followers do); rank 0
writes what the test compares with a single-process trainer: the weights as
loaded (gathered back to Hugging Face names), the recomputed log-probs, the
step's metrics, the weights after the step, whether a trainer resumed
from a checkpoint of all ranks takes the next step exactly as the original, and
how far the log-probs and entropies summed over the ranks' shares of a
vocabulary (and their gradients, the entropy's too) are from one process's.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conftest import plain_sgd  # the script's folder, tests/, is on sys.path
from vime.algorithms.grpo import GRPOConfig
from vime.algorithms.policy_loss import PolicyLossConfig
from vime.algorithms.ppo import PPOConfig
from vime.backends.base import TensorBatch
from vime.backends.megatron import MegatronTrainEngine
from vime.backends.plain_collectives import gather_plain
from vime.config import OptimConfig


def main(folder: str, batch_file: str, out: str, tensor_parallel: int, expert_parallel: int, data_parallel: int,
         recompute: bool) -> None:
    build = functools.partial(grpo_with_sgd, folder, 1, tensor_parallel=tensor_parallel,
                              expert_parallel=expert_parallel, data_parallel=data_parallel, recompute=recompute)

    engine = build()
    batch = TensorBatch(**torch.load(batch_file, weights_only=True))
    weights = functools.partial(gathered_weights, engine)
    loaded = weights()
    streamed = [(name, tensor.clone()) for name, tensor in engine.rollout_weights(torch.bfloat16)]  # every rank
    logprobs = engine.score(batch)["old_logprobs"]
    metrics = engine.train_step(batch)
    trained = weights("cpu")  # as sent over nng: gathered and moved one tensor at a time
    checkpoint = Path(out).with_name("checkpoint")
    engine.save(checkpoint)  # every rank its own optimizer state, rank 0 the model
    resumed = build()
    resumed.load(checkpoint)
    resumed_alike = resumed.train_step(batch) == engine.train_step(batch)
    vocabulary_gaps = vocab_parallel_gaps()
    if dist.get_rank() == 0:
        torch.save({"loaded": loaded, "streamed": streamed, "logprobs": logprobs, "metrics": metrics,
                    "trained": trained, "resumed_alike": resumed_alike, "vocabulary_gaps": vocabulary_gaps}, out)
    dist.destroy_process_group()


def grpo_with_sgd(folder: str, updates_per_step: int, max_tokens: int = 0, **layout: Any) -> MegatronTrainEngine:
    """GRPO with a KL reference in ``layout`` (the engine's parallel sizes and ``recompute``), micro-batches of 2
    (with ``max_tokens``, of that many tokens packed into one row: ``--use-dynamic-batch-size``), plain SGD
    (:func:`plain_sgd`): AdamW's step is blind to the gradient's scale, so to whether it was clipped."""
    optim = OptimConfig(updates_per_step=updates_per_step, micro_batch_size=2,
                        use_dynamic_batch_size=bool(max_tokens), max_tokens_per_gpu=max_tokens)
    engine = MegatronTrainEngine(folder, algo="grpo", optim=optim,
                                 loss=PolicyLossConfig(kl_loss_coef=0.1), grpo_config=GRPOConfig(),
                                 ppo_config=PPOConfig(), temperature=0.7, total_steps=4, **layout)
    plain_sgd(engine)
    return engine


def train_ppo(folder: str, batch_file: str, out: str, tensor_parallel: int, expert_parallel: int,
              data_parallel: int, recompute: bool, pipeline_parallel: int) -> None:
    """PPO on every rank, plain SGD (:func:`plain_sgd`): rank 0 writes the step's metrics, the policy's weights
    after it (gathered from every stage), the value model's values after it (the head has moved off zero), and
    the metrics of the next step of the original and of a trainer resumed from a checkpoint of all ranks
    (``again``, ``resumed``: compared NaN-aware, since pipeline stages get the metrics as msgpack, a NaN among
    them no longer ``math.nan`` itself)."""
    def build() -> MegatronTrainEngine:
        engine = MegatronTrainEngine(folder, algo="ppo", optim=OptimConfig(updates_per_step=2, micro_batch_size=2),
                                     loss=PolicyLossConfig(), grpo_config=GRPOConfig(), ppo_config=PPOConfig(),
                                     temperature=0.7, total_steps=4, tensor_parallel=tensor_parallel,
                                     expert_parallel=expert_parallel, data_parallel=data_parallel,
                                     recompute=recompute, pipeline_parallel=pipeline_parallel)
        plain_sgd(engine, lr=0.5)
        return engine

    engine = build()
    batch = TensorBatch(**torch.load(batch_file, weights_only=True))
    metrics = engine.train_step(batch)
    trained = gathered_weights(engine, "cpu")
    values = engine.score(batch)["values"]
    checkpoint = Path(out).with_name("checkpoint")
    engine.save(checkpoint)
    resumed = build()
    resumed.load(checkpoint)
    again = {"resumed": resumed.train_step(batch), "again": engine.train_step(batch)}
    if dist.get_rank() == 0:
        torch.save({"metrics": metrics, "trained": trained, "values": values, **again}, out)
    dist.destroy_process_group()


def gathered_weights(engine: MegatronTrainEngine, device: str | None = None) -> dict[str, torch.Tensor]:
    """Rank 0 gathers the weights as the trainer actor's engine does (copies: some alias the weights); the others
    join as followers do, and get nothing."""
    if dist.get_rank() == 0:
        return {name: tensor.clone() for name, tensor in engine.named_weights(device).items()}
    engine.join_weight_gather()
    return {}


def tied_copies_alike(engine: MegatronTrainEngine) -> bool:
    """Whether a tied embedding's two copies, the first pipeline stage's and the last's (its output layer), are
    bit for bit the same on every embedding group; True without such copies. Every rank calls it."""
    from megatron.core import parallel_state

    model = engine.policy.model
    differ = torch.zeros(())
    if engine.pipeline_parallel > 1 and model.share_embeddings_and_output_weights:
        weight = model.shared_embedding_or_output_weight().detach()
        group = parallel_state.get_embedding_group()
        copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, weight.contiguous(), group=group)
        differ += sum(not torch.equal(copies[0], copy) for copy in copies)
    dist.all_reduce(differ)
    return differ.item() == 0


def train_across_layouts(folder: str, batches_file: str, out: str, tensor_parallel: int, expert_parallel: int,
                         data_parallel: int, pipeline_parallel: int, algo: str, dtype: str, role: str) -> None:
    """One side of a checkpoint that changes layout, with AdamW (its moments are what must carry over). ``save``:
    train on the first batch, save beside ``out``, then go on to the second; ``resume``: load that checkpoint
    (saved by the test's process or by other ranks, in their layout) and train on the second. Rank 0 writes the
    weights before the second step, its metrics, the weights after it and, for ppo, the value model's values
    then. The settings are those the test's ``_engine`` gives its one-process trainer."""
    engine = MegatronTrainEngine(folder, algo=algo, optim=OptimConfig(lr=1e-3, updates_per_step=2, micro_batch_size=2),
                                 loss=PolicyLossConfig(), grpo_config=GRPOConfig(), ppo_config=PPOConfig(),
                                 temperature=0.7, total_steps=4, dtype=dtype, tensor_parallel=tensor_parallel,
                                 expert_parallel=expert_parallel, data_parallel=data_parallel,
                                 pipeline_parallel=pipeline_parallel)
    first, second = (TensorBatch(**fields) for fields in torch.load(batches_file, weights_only=True))
    checkpoint = Path(out).with_name("checkpoint")
    if role == "save":
        engine.train_step(first)
        engine.save(checkpoint)
    else:
        engine.load(checkpoint)
    before = gathered_weights(engine, "cpu")
    metrics = engine.train_step(second)
    weights = gathered_weights(engine, "cpu")
    values = engine.score(second)["values"] if algo == "ppo" else None
    tied_alike = tied_copies_alike(engine)
    if dist.get_rank() == 0:
        torch.save({"before": before, "metrics": metrics, "weights": weights, "values": values,
                    "tied_alike": tied_alike}, out)
    dist.destroy_process_group()


def train_with_distributed_optimizer(folder: str, batches_file: str, out: str, tensor_parallel: int,
                                     expert_parallel: int, data_parallel: int, algo: str, dtype: str,
                                     pipeline_parallel: int) -> None:
    """The plain optimizer and the distributed one (``distributed_optimizer``) train side by side on the same
    ranks, AdamW with a decaying learning rate (which the schedule sets on the whole tensors' groups and the
    parts must follow, a resumed trainer too), a step on each batch; the distributed one saves before the last
    step and a trainer resumed from that checkpoint takes it too. Rank 0 writes each trainer's metrics of every
    step, its weights after the last (gathered; the resumed one's as ``resumed``) and every rank's
    optimizer-state bytes (``state_bytes``: plain, distributed) and fp32 masters' bytes (``master_bytes``)."""
    from vime.backends.megatron.distributed_optimizer import master_bytes, state_bytes

    def build(distributed_optimizer: bool) -> MegatronTrainEngine:
        return MegatronTrainEngine(folder, algo=algo, optim=OptimConfig(lr=1e-3, updates_per_step=2,
                                                                        micro_batch_size=2, lr_schedule="linear"),
                                   loss=PolicyLossConfig(), grpo_config=GRPOConfig(), ppo_config=PPOConfig(),
                                   temperature=0.7, total_steps=4, dtype=dtype, tensor_parallel=tensor_parallel,
                                   expert_parallel=expert_parallel, data_parallel=data_parallel,
                                   distributed_optimizer=distributed_optimizer, pipeline_parallel=pipeline_parallel)

    batches = [TensorBatch(**fields) for fields in torch.load(batches_file, weights_only=True)]
    engines = {"plain": build(False), "distributed": build(True)}
    metrics: dict[str, list[dict]] = {name: [] for name in engines}
    checkpoint = Path(out).with_name("checkpoint")
    for index, batch in enumerate(batches):
        if index == len(batches) - 1:
            engines["distributed"].save(checkpoint)
        for name, engine in engines.items():
            metrics[name].append(engine.train_step(batch))
    resumed = build(True)
    resumed.load(checkpoint)
    metrics["resumed"] = [resumed.train_step(batches[-1])]
    tied_alike = [tied_copies_alike(engine) for engine in (*engines.values(), resumed)]
    weights = {name: gathered_weights(engine, "cpu") for name, engine in {**engines, "resumed": resumed}.items()}
    sizes = gather_plain([[state_bytes(engine.optimizer) for engine in engines.values()],
                          [master_bytes(engine.masters) for engine in engines.values()]])
    if dist.get_rank() == 0:
        torch.save({"metrics": metrics, "weights": weights, "state_bytes": [rank[0] for rank in sizes],
                    "master_bytes": [rank[1] for rank in sizes], "tied_alike": tied_alike}, out)
    dist.destroy_process_group()


def train_in_stages(folder: str, batches_file: str, out: str, tensor_parallel: int, pipeline_parallel: int,
                    data_parallel: int, expert_parallel: int, recompute: bool) -> None:
    """Pipeline stages (of tensor-parallel ranks, in ``data_parallel`` copies; an MoE model's experts divided among
    ``expert_parallel`` of each stage's ranks; their layers recomputed with ``recompute``) train GRPO with a KL
    reference
    (scored through the stages too), two mini-batches of micro-batches of 2 per step, plain SGD (:func:`plain_sgd`:
    the update is the clipped gradient), a step on each batch. Rank 0 writes the weights as loaded and as
    streamed to rollout engines, the scores before the first step, every step's metrics, the weights after each
    step, the Hugging Face folder ``save_hf`` wrote (beside ``out``), and the metrics of a trainer resumed from a
    checkpoint (one file per stage and rank) before the last step, taking it again."""
    build = functools.partial(grpo_with_sgd, folder, 2, tensor_parallel=tensor_parallel,
                              pipeline_parallel=pipeline_parallel, data_parallel=data_parallel,
                              expert_parallel=expert_parallel, recompute=recompute)

    engine = build()
    batches = [TensorBatch(**fields) for fields in torch.load(batches_file, weights_only=True)]
    loaded = gathered_weights(engine)
    streamed = [(name, tensor.clone()) for name, tensor in engine.rollout_weights(torch.bfloat16)]  # every rank
    scores = engine.score(batches[0])
    checkpoint = Path(out).with_name("checkpoint")
    metrics, trained, tied_alike = [], [], []
    for index, batch in enumerate(batches):
        if index == len(batches) - 1:
            engine.save(checkpoint)
        metrics.append(engine.train_step(batch))
        trained.append(gathered_weights(engine, "cpu"))
        tied_alike.append(tied_copies_alike(engine))
    engine.save_hf(Path(out).with_name("hf"))
    resumed = build()
    resumed.load(checkpoint)
    resumed_metrics = resumed.train_step(batches[-1])
    if dist.get_rank() == 0:
        torch.save({"loaded": loaded, "streamed": streamed, "scores": scores, "metrics": metrics, "trained": trained,
                    "resumed": resumed_metrics, "tied_alike": tied_alike}, out)
    dist.destroy_process_group()


def train_packed_and_padded(folder: str, batch_file: str, out: str, tensor_parallel: int, expert_parallel: int,
                            data_parallel: int, pipeline_parallel: int, max_tokens: int) -> None:
    """Two trainers on the same ranks (:func:`grpo_with_sgd`, two updates per step): right-padded
    micro-batches of 2 samples (``padded``), and micro-batches of ``max_tokens`` packed into one row each
    (``packed``). Rank 0 writes each one's scored log-probs and entropies, its step's metrics and its weights
    after the step (gathered)."""
    batch = TensorBatch(**torch.load(batch_file, weights_only=True))
    results = {}
    for name, tokens in (("padded", 0), ("packed", max_tokens)):
        engine = grpo_with_sgd(folder, 2, max_tokens=tokens, tensor_parallel=tensor_parallel,
                               expert_parallel=expert_parallel, data_parallel=data_parallel,
                               pipeline_parallel=pipeline_parallel)
        scores = engine.score(batch)
        metrics = engine.train_step(batch)
        results[name] = {"logprobs": scores["old_logprobs"], "entropy": scores["entropy"], "metrics": metrics,
                         "weights": gathered_weights(engine, "cpu")}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def vocab_parallel_gaps() -> list[float]:
    """Largest differences, over every rank, of ``vocab_parallel_token_stats`` on the rank's share of random
    logits (a view, as the trainer passes it) from ``token_stats`` on the whole: log-probs, entropies, and
    (relative to its largest entry) the gradient of a loss that mixes them non-linearly, with the entropy's
    gradient and without, and worked through in pieces smaller than a row; a NaN counts as infinitely far."""
    from megatron.core import parallel_state

    from vime.backends.hf import token_stats
    from vime.backends.megatron import vocab_parallel_token_stats

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(7)
    gaps = []
    for entropy_grad, piece_elements in ((True, 1 << 26), (False, 1 << 26), (True, 100)):  # 100: rows in pieces
        whole = (3 * torch.randn(3, 6, 64, generator=generator)).to(device).requires_grad_()
        targets = torch.randint(0, 64, (3, 5), generator=generator).to(device)
        weights = torch.randn(2, 3, 5, generator=generator).to(device)
        rank = parallel_state.get_tensor_model_parallel_rank()
        ranks = parallel_state.get_tensor_model_parallel_world_size()
        base = whole.detach().chunk(ranks, dim=-1)[rank].clone().requires_grad_()
        stats = []
        for stats_of, logits in ((token_stats, whole[:, 1:]),
                                 (functools.partial(vocab_parallel_token_stats, piece_elements=piece_elements),
                                  base[:, 1:])):
            logprobs, entropy = stats_of(logits, targets, 0.7, entropy_grad=entropy_grad)
            ((weights[0] * logprobs**2).sum() + (weights[1] * entropy * logprobs).sum()).backward()
            stats.append((logprobs, entropy))
        (expected, got), mine = stats, whole.grad.chunk(ranks, dim=-1)[rank]
        gaps += [float((a - b).abs().max()) for a, b in zip(got, expected)]
        gaps.append(float((base.grad - mine).abs().max() / mine.abs().max()))  # relative: the loss is squared
    gaps = torch.tensor(gaps, device=device).nan_to_num(nan=float("inf"))
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)
    return gaps.tolist()


def lead_and_lose_a_follower(folder: str) -> None:
    """Rank 0 as the trainer actor holds it: kill rank 1, then order a call; print what the leader says. Then
    hold a call open, as one stuck in a collective with the dead rank would be: the leader's process ends."""
    from vime import logs
    from vime.backends.tensor_parallel import LeadingEngine
    from vime.config import RunConfig

    logs.configure()
    run = RunConfig().replace(model_path=folder, train_backend="megatron", tensor_model_parallel_size=2)
    engine = LeadingEngine(run, seed=0)
    engine.followers[0].kill()
    engine.followers[0].wait()
    try:
        engine.named_weights()
    except RuntimeError as error:
        print("REFUSED", error, flush=True)
    with engine._lock:  # a call waiting on the dead rank, as an NCCL collective on one host would
        time.sleep(60)
    print("NOT STOPPED", flush=True)


def lead_a_follower_that_dies_starting(folder: str) -> None:
    """Rank 0 starts a rank 1 that exits before it joins the group (as one out of memory, or without the model
    on its host, would): the leader, waiting for it to join, must end within seconds, not the group's timeout."""
    import subprocess

    from vime import logs
    from vime.backends.tensor_parallel import LeadingEngine
    from vime.config import RunConfig

    logs.configure()
    run = RunConfig().replace(model_path=folder, train_backend="megatron", tensor_model_parallel_size=2)
    LeadingEngine(run, seed=0, launch=lambda slot, spec: subprocess.Popen([sys.executable, "-c", "exit(3)"]))
    print("NOT STOPPED", flush=True)


def lead_and_release(folder: str, out: str) -> None:
    """Rank 0 as the trainer actor holds it orders its follower to give its cached memory back, then gathers the
    weights: the follower must have come out of the first order in step to join the second."""
    from vime.backends.tensor_parallel import LeadingEngine
    from vime.config import RunConfig

    run = RunConfig().replace(model_path=folder, train_backend="megatron", tensor_model_parallel_size=2)
    engine = LeadingEngine(run, seed=0)
    engine.release_memory()
    torch.save({name: tensor.clone() for name, tensor in engine.named_weights().items()}, out)
    engine.close()


def relay_a_batch(batch_file: str, out: str) -> None:
    """Rank 0 sends the batch as it orders a training step; rank 1 receives it and writes what it got."""
    from vime.backends.tensor_parallel import _receive_batch, _send_batch

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        _send_batch(TensorBatch(**torch.load(batch_file, weights_only=True)), "cpu")
    else:
        received = _receive_batch("cpu")
        torch.save({name: getattr(received, name) for name in received.__dataclass_fields__}, out)
    dist.destroy_process_group()


def stall(which: str) -> None:
    """For the tests of ``forked_ranks`` itself: every rank joins the group, then rank 0 exits with code 3
    (``which`` is ``after-rank-0-fails``) or stays too (``all``), and the others wait without end, as a rank waiting
    on a dead peer may (gloo notices a closed connection; a wait on the store, or a GPU kernel, does not)."""
    dist.init_process_group("gloo")
    if which == "after-rank-0-fails" and dist.get_rank() == 0:
        sys.exit(3)
    # not flushed: the log must keep it when the rank is killed
    print(f"rank {dist.get_rank()} waits as process {os.getpid()}", flush=False)
    time.sleep(3600)


class _Buckets:
    """Stands in for a rank's engine in :func:`share_buckets`: three buckets, each "offered" as a descriptor
    naming the rank and the bucket (a CPU has nothing to share over CUDA IPC); it counts what it made."""

    device = "cpu"

    def __init__(self) -> None:
        self.made: list[int] = []

    def shared_buckets(self, bucket_bytes: int, dtype: torch.dtype):
        for index in range(3):
            self.made.append(index)
            yield [[f"w{index}", [bucket_bytes], str(dtype)]], [{"rank": dist.get_rank(), "bucket": index}]


def share_buckets(out: str) -> None:
    """Ranks share buckets as a tensor-parallel trainer does: rank 0 takes all three, then stops after the
    first, then takes all three again; each rank writes what it got and made, how many of rank 0's messages
    it sent or read, and which of them the store still holds."""
    from torch.distributed import distributed_c10d

    from vime.backends.tensor_parallel import Orders, _shared_in_step

    dist.init_process_group("gloo")
    engine, orders = _Buckets(), Orders(distributed_c10d._get_default_store())
    runs = []
    for stop_after in (None, 1, None):
        got = []
        steps = _shared_in_step(engine, orders, 64, torch.bfloat16)
        for specs, offered in steps:
            got.append([specs, offered])
            if len(got) == stop_after:
                steps.close()
                break
        runs.append({"got": got, "made": engine.made})
        engine.made = []
    dist.barrier()  # every rank has read every message: the store should hold none of them now
    left = [key for key in (f"vime/order/{count}" for count in range(1, orders.count + 1)) if orders.store.check([key])]
    with open(f"{out}.{dist.get_rank()}", "w") as file:
        json.dump({"runs": runs, "messages": orders.count, "left": left}, file)
    dist.destroy_process_group()


def run(argv: list[str]) -> None:
    """The mode ``argv[0]`` names, with the rest of ``argv``: the command line without the script, under
    torchrun or forked by ``forked_ranks.run_ranks``."""
    if argv[0] == "lose-a-follower":
        lead_and_lose_a_follower(argv[1])
    elif argv[0] == "lose-a-starting-follower":
        lead_a_follower_that_dies_starting(argv[1])
    elif argv[0] == "relay-a-batch":
        relay_a_batch(argv[1], argv[2])
    elif argv[0] == "lead-and-release":
        lead_and_release(argv[1], argv[2])
    elif argv[0] == "share-buckets":
        share_buckets(argv[1])
    elif argv[0] == "stall":
        stall(argv[1])
    elif argv[0] == "layouts":
        train_across_layouts(*argv[1:4], *map(int, argv[4:8]), *argv[8:11])
    elif argv[0] == "distributed-optimizer":
        train_with_distributed_optimizer(*argv[1:4], *map(int, argv[4:7]), *argv[7:9], int(argv[9]))
    elif argv[0] == "pipeline":
        train_in_stages(*argv[1:4], *map(int, argv[4:8]), argv[8] == "recompute")
    elif argv[0] == "packed":
        train_packed_and_padded(*argv[1:4], *map(int, argv[4:9]))
    elif argv[0] == "ppo":
        train_ppo(*argv[1:4], int(argv[4]), int(argv[5]), int(argv[6]), argv[7] == "recompute",
                  int(argv[8]))
    else:
        main(argv[0], argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]),
             argv[6] == "recompute")


if __name__ == "__main__":
    run(sys.argv[1:])
