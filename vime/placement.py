"""Which GPUs each actor process sees: the trainer's, each rollout engine's, none for the rest.

Driven by slime's flags (``--actor-num-gpus-per-node``, ``--rollout-num-gpus``,
``--rollout-num-gpus-per-engine``, ``--colocate``) and the GPUs this host shows
(``CUDA_VISIBLE_DEVICES``, else all). Separate placements give the trainer the first GPUs and the
engines the next ones; colocated engines take the trainer's GPUs. ``--rollout-workers`` a multiple
of the engine slots puts several engines on each slot's GPUs (small models, whose engines are
bound by the host's per-step work rather than by the GPU). A process is placed by setting
its ``CUDA_VISIBLE_DEVICES``, so inside it the first GPU is always its own.

The weight path follows from where the processes land (``--weight-sync auto``, the default): the
trainer compares the GPUs a worker's engine reports with its own (CUDA IPC on the same GPUs, a broadcast group
across GPUs; see ``vime.weights.choose``). Workers joined from other hosts keep the
GPUs their own environment gives them.

With none of the GPU flags given, nothing is placed: every process inherits the driver's view.
"""

from __future__ import annotations

import dataclasses
import os

from vime.config import RunConfig

_ENGINES_SHARE = 0.9  # of a GPU's memory, at most, for the vLLM engines that share it (vLLM's own default)


@dataclasses.dataclass(frozen=True)
class Placement:
    """``CUDA_VISIBLE_DEVICES`` per process; ``None`` leaves the driver's own in place."""

    trainer: str | None
    engines: list[str | None]  # one per rollout worker
    others: str | None  # router, reward, buffer: no GPU when anything is placed


def environment(devices: str | None) -> dict[str, str]:
    """What a process placed on ``devices`` (a field of a :class:`Placement`) adds to its environment."""
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: ``CUDA_VISIBLE_DEVICES`` as given (indices or UUIDs), else all."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def place(config: RunConfig, gpus: list[str]) -> Placement:
    """Where each process goes on a host with ``gpus``; a ValueError says which flags to change."""
    layout, rollout = config.placement, config.rollout
    per_engine = rollout.rollout_num_gpus_per_engine
    nodes, per_node = layout.actor_num_nodes, layout.actor_num_gpus_per_node
    if nodes > 1:
        check_trainer_nodes(config)
    # a trainer over several hosts whose head shows no GPU runs on CPU, per_node ranks a host (gloo)
    trainer_gpus = per_node if nodes == 1 or gpus else 0
    if layout.rollout_nodes and (layout.rollout_num_gpus or layout.colocate):
        raise ValueError("--rollout-nodes places CPU rollout workers on the nodes so far: leave --rollout-num-gpus "
                         "and --colocate out, or run GPU engines on this host")
    if layout.rollout_nodes > rollout.rollout_workers:
        raise ValueError(f"--rollout-nodes {layout.rollout_nodes} spreads --rollout-workers "
                         f"{rollout.rollout_workers} over the nodes: give at least one worker per node")
    if not (trainer_gpus or layout.rollout_num_gpus or layout.colocate):
        return Placement(None, [None] * rollout.rollout_workers, None)
    if trainer_gpus and trainer_gpus * nodes != config.job.trainer_ranks:
        raise ValueError(f"--actor-num-gpus-per-node {trainer_gpus}: the trainer runs one rank per GPU, "
                         f"--tensor-model-parallel-size x --data-parallel-size x --pipeline-model-parallel-size of "
                         f"them ({config.job.tensor_model_parallel_size} x {config.job.data_parallel_size} x "
                         f"{config.job.pipeline_model_parallel_size}); make the product the GPU count, or leave "
                         "--data-parallel-size out on the command line, which derives it from the GPUs")
    if trainer_gpus and config.job.train_backend != "megatron":
        raise ValueError("--actor-num-gpus-per-node: the reference trainer runs on CPU; pass --train-backend megatron")
    rollout_gpus = layout.rollout_num_gpus
    if layout.colocate:
        if not trainer_gpus:
            raise ValueError("--colocate puts the rollout engines on the trainer's GPUs: pass "
                             "--actor-num-gpus-per-node too")
        if rollout_gpus not in (0, trainer_gpus):
            raise ValueError(f"--colocate shares the trainer's {trainer_gpus} GPU(s): --rollout-num-gpus must be "
                             f"{trainer_gpus} or left out, not {rollout_gpus}")
        rollout_gpus = trainer_gpus
    if rollout_gpus and rollout.rollout_backend != "vllm":
        raise ValueError("--rollout-num-gpus: the reference rollout engine runs on CPU; pass --rollout-backend vllm")
    if rollout_gpus % per_engine:
        raise ValueError(f"--rollout-num-gpus {rollout_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                         f"{per_engine}")
    slots = rollout_gpus // per_engine if rollout_gpus else rollout.rollout_workers
    if rollout.rollout_workers > 1 and rollout.rollout_workers % slots:
        raise ValueError(f"--rollout-workers {rollout.rollout_workers} is not a multiple of the {slots} engine slots "
                         f"of --rollout-num-gpus {rollout_gpus} / --rollout-num-gpus-per-engine {per_engine}; leave "
                         "--rollout-workers out for one engine per slot")
    sharing = max(1, rollout.rollout_workers // slots)  # engines on each slot's GPUs
    utilization = rollout.vllm_args.get("gpu_memory_utilization")
    if rollout_gpus and sharing > 1 and (utilization is None or utilization * sharing > _ENGINES_SHARE):
        raise ValueError(f"{sharing} engines share each rollout GPU, each taking --vllm-gpu-memory-utilization of "
                         f"its memory: pass at most {_ENGINES_SHARE / sharing:.2f} (less beside a colocated trainer)")
    needed = trainer_gpus + (0 if layout.colocate else rollout_gpus)
    if needed > len(gpus):
        raise ValueError(f"this placement needs {needed} GPUs (trainer {trainer_gpus}, rollout "
                         f"{0 if layout.colocate else rollout_gpus}) but this host shows {len(gpus)}"
                         f"{' (CUDA_VISIBLE_DEVICES=' + ','.join(gpus) + ')' if gpus else ''}")
    trainer = gpus[:trainer_gpus]
    pool = trainer if layout.colocate else gpus[trainer_gpus:needed]
    engine_gpus: list[str | None] = [",".join(pool[i % slots * per_engine:(i % slots + 1) * per_engine])
                                     for i in range(slots * sharing)] if rollout_gpus else [""] * slots
    return Placement(",".join(trainer), engine_gpus, "")


def check_trainer_nodes(config: RunConfig) -> None:
    """A trainer over ``--actor-num-nodes`` hosts: Megatron's, ``--actor-num-gpus-per-node`` ranks on each (GPUs,
    or processes on CPU), its ranks all placed, tensor-parallel groups within a host (``vime.trainer_ranks``
    places them over the nodes that join). ValueError naming the flag to change."""
    layout, job = config.placement, config.job
    nodes, per_node = layout.actor_num_nodes, layout.actor_num_gpus_per_node
    if job.train_backend != "megatron":
        raise ValueError(f"--actor-num-nodes {nodes}: only the Megatron trainer spans hosts; pass --train-backend "
                         "megatron")
    if per_node * nodes != job.trainer_ranks:
        raise ValueError(f"--actor-num-nodes {nodes} x --actor-num-gpus-per-node {per_node} (ranks per host on CPU) "
                         f"must be the trainer's {job.trainer_ranks} ranks (--tensor-model-parallel-size "
                         f"{job.tensor_model_parallel_size} x --data-parallel-size {job.data_parallel_size} x "
                         f"--pipeline-model-parallel-size {job.pipeline_model_parallel_size})")
    if per_node % job.tensor_model_parallel_size:
        raise ValueError(f"--actor-num-gpus-per-node {per_node} would split a tensor-parallel group of "
                         f"--tensor-model-parallel-size {job.tensor_model_parallel_size} over hosts; make it a "
                         "multiple of it")


def describe(config: RunConfig, placed: Placement) -> list[str]:
    """What ``placed`` means, a line per process: its GPUs and, for each rollout worker, the weight path
    ``--weight-sync`` takes to it (as the trainer will choose it from the GPUs the engine reports; ValueError
    when the path named cannot serve that placement). For ``--dry-run``."""
    from vime.weights import choose  # every path registered; torch comes with it: not for parsing the command line

    job, rollout = config.job, config.rollout
    ranks = (f"{job.trainer_ranks} rank(s): tensor parallel {job.tensor_model_parallel_size} x data parallel "
             f"{job.data_parallel_size}" + (f", expert parallel {job.expert_model_parallel_size}"
                                            if job.expert_model_parallel_size > 1 else "")
             + (f", pipeline parallel {job.pipeline_model_parallel_size}"
                if job.pipeline_model_parallel_size > 1 else ""))
    layout = config.placement
    if layout.actor_num_nodes > 1:
        per_node = layout.actor_num_gpus_per_node
        ranks += (f"; ranks 0-{per_node - 1} on this host, the next {per_node} on each of {layout.actor_num_nodes - 1} "
                  "node agent(s) as they join (vime.trainer_ranks)")
    if placed.trainer is None:
        return [f"trainer ({job.train_backend}, {ranks}) and {len(placed.engines)} rollout worker(s) "
                f"({rollout.rollout_backend}): nothing placed (no GPU flag given), each sees the GPUs this host "
                "shows; the weight path is chosen at start from the GPUs each engine reports"]
    lines = [f"trainer: GPUs {placed.trainer or 'none (CPU)'} ({job.train_backend}, {ranks})"]
    trainer_gpus = placed.trainer.split(",") if placed.trainer else []
    for index, gpus in enumerate(placed.engines):
        engine_gpus = gpus.split(",") if gpus else []
        path = choose(job.weight_sync, trainer_gpus, engine_gpus)
        lines.append(f"rollout worker {index}: GPUs {gpus or 'none (CPU)'} ({rollout.rollout_backend}, "
                     f"{rollout.rollout_num_gpus_per_engine} GPU(s) per engine); weights by {path.name}")
    lines.append("router, reward, buffer: no GPU")
    return lines
