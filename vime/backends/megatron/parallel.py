"""Process groups and ranks: setting up torch.distributed and megatron-core's groups, which ranks split a
sequence, and two collectives over those groups: a gather of the sequence-parallel shares (recorded
experts, for ``model.forward``) and a bucketed sum of tensors (gradients, for ``engine``).

What a rank holds of each tensor, and the gathers that make it whole again, are in ``weights``; the
vocabulary-parallel log-probs' collectives are in ``logprobs``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from vime.architecture import expert_tensor_parallel
from vime.backends import cpu_compat
from vime.config import check_expert_parallel


def init_parallel(tensor_parallel: int = 1, expert_parallel: int = 1, data_parallel: int = 1,
                  pipeline_parallel: int = 1) -> None:
    """Set up torch.distributed and megatron-core's process groups, once per process.

    Megatron's layers look up their tensor/pipeline/expert groups globally, so
    even a single-process model needs them. Under ``torchrun`` the world is the
    launcher's (NCCL on GPUs, one per local rank; gloo on CPU): ``data_parallel``
    copies of a tensor-parallel group, consecutive ranks in a copy, for each of
    ``pipeline_parallel`` stages (megatron-core's order: the stage varies slowest,
    so rank 0 holds the first stage); with no
    launcher around, it is a world of one over an in-memory store (no port).
    ``expert_parallel`` divides the routed experts among the ranks of a copy
    (``tensor_parallel``) or of all copies (``tensor_parallel x data_parallel``),
    each holding its experts whole; at 1 each rank holds a share of every
    expert. Without CUDA (tests), megatron-core is first patched to place
    tensors on the CPU.
    """
    check_expert_parallel(tensor_parallel, data_parallel, expert_parallel)
    ranks = tensor_parallel * data_parallel * pipeline_parallel
    cpu_compat.apply()
    launched = "LOCAL_RANK" in os.environ
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) if launched else torch.cuda.current_device())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if launched:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != ranks:
        raise ValueError(f"{dist.get_world_size()} processes for --tensor-model-parallel-size {tensor_parallel} x "
                         f"--data-parallel-size {data_parallel} x --pipeline-model-parallel-size {pipeline_parallel}: "
                         f"launch with torchrun --nproc-per-node {ranks}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 pipeline_model_parallel_size=pipeline_parallel,
                                                 expert_model_parallel_size=expert_parallel,
                                                 expert_tensor_parallel_size=expert_tensor_parallel(
                                                     tensor_parallel, expert_parallel))
        if torch.cuda.is_available():
            # Megatron forks the CUDA RNG tracker's state around dropout, and under sequence parallelism around
            # every layer, dropout or not: it must be seeded
            model_parallel_cuda_manual_seed(0)
    elif (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size(),
          parallel_state.get_data_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()) != (
              tensor_parallel, expert_parallel, data_parallel, pipeline_parallel):
        raise ValueError("this process already holds a model of another tensor-, expert-, data- or pipeline-parallel "
                         "size")


def stage_layers(num_layers: int) -> range:
    """The whole model's layers (0-based) that this rank's pipeline stage holds: an even, contiguous share,
    megatron-core's own split (``conversion.transformer_config`` refuses a count the stages do not divide). The one
    place stages are laid out; a built stage's own layers say the same (``layer_number``)."""
    per_stage = num_layers // parallel_state.get_pipeline_model_parallel_world_size()
    first = parallel_state.get_pipeline_model_parallel_rank() * per_stage
    return range(first, first + per_stage)


def _sequence_ranks(model: GPTModel) -> tuple[int, int]:
    """``(rank, ranks)`` among which sequence parallelism splits ``model``'s tokens; ``(0, 1)`` without it."""
    if not model.config.sequence_parallel:
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _gather_sequence(local: torch.Tensor, ranks: int) -> torch.Tensor:
    """``[layers, tokens, k]`` of every rank's share of the tokens, joined in rank order (a collective)."""
    if ranks == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(pieces, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=1)


def _sum_over(tensors: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int = 256 << 20) -> None:
    """Sum ``tensors`` in place over ``group``'s ranks, a few collectives of up to ``bucket_bytes`` each (one
    per tensor would be thousands; one for all would double the gradients' memory)."""
    if dist.get_world_size(group) == 1:
        return
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        if not buckets or size >= bucket_bytes or buckets[-1][0].dtype != tensor.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel() * tensor.element_size()
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))
