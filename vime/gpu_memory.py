"""Will the trainer's state fit its GPUs? Checked before any actor starts, so that a layout that cannot fit fails
at start with what to change, instead of mid-run.

A Megatron run that does not fit used to fail late: the weights load at start, but AdamW makes its moments at the
first optimizer step and the gradients fill at the first backward, so the out-of-memory error came after the
engines were built and the first batch generated -- minutes in, or, beside a colocated vLLM engine that is awake,
at whichever step first met a long batch. Here the part of the per-GPU memory that does not depend on the batch
is counted from the model's own shapes, and the run is refused when that part alone, with what a colocated
awake engine holds, is more than the card has.

What is counted, per trainer GPU (the rank holding the most):

* the parameters of its pipeline stage and tensor/expert-parallel share, counted on a Hugging Face model built
  on the ``meta`` device (no memory, no weights read): embedding on the first stage, output layer on the last
  (once when tied and there is one stage), norms and routers whole on every rank, experts divided by expert x
  expert-tensor parallelism (exact on one rank: the test compares it with megatron-core's GPTModel);
* per parameter, megatron-core's figures (``vime.backends.megatron.distributed_optimizer``): in bf16 2 bytes of
  weight, 4 of gradient and 12 of fp32 master and Adam moments; in fp32 4 + 4 + 8. With
  ``--use-distributed-optimizer`` the masters and moments are divided over the data-parallel copies;
* PPO's value model likewise (its own backbone, no output layer); a KL reference model's weights only;
* with ``--colocate`` and no sleep mode, the ``--vllm-gpu-memory-utilization`` share of the card each engine
  on the GPU keeps through the training step: vLLM sizes its KV cache to fill that budget, less the activations
  of its profiling pass, which it frees (small beside the budget at any size it is used at).

Not counted: activations (they depend on the batch and ``--recompute-*``), the CUDA context, allocator
fragmentation, a sleeping engine's remains. So the trainer's part is a lower bound, and a refused run could not
have run; a run that passes can still run out of memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import subprocess
from collections.abc import Iterable
from typing import Any

from vime.architecture import expert_tensor_parallel

GIB = 2**30
_LAYER = re.compile(r"\blayers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class TrainerMemory:
    """The batch-independent bytes of one trainer GPU (the stage and rank that hold the most), by kind."""

    parameters: int  # of the policy on that GPU
    experts: bool  # some of them are routed experts (--expert-model-parallel-size divides those)
    state_bytes: int  # weights, gradients, masters and moments of everything trained there, and a reference
    engines: int = 0  # colocated rollout engines awake on that GPU through a training step
    engine_bytes: int = 0  # what they keep

    @property
    def total(self) -> int:
        return self.state_bytes + self.engine_bytes


def parameters_per_gpu(hf_config: Any, *, tensor: int = 1, pipeline: int = 1, expert: int = 1,
                       output_layer: bool = True) -> list[tuple[int, int]]:
    """(dense, expert) parameters each pipeline stage's GPU holds, for a model of ``hf_config``; with
    ``output_layer`` False (a value model) the output projection is left out."""
    counts = [[0, 0] for _ in range(pipeline)]
    layers = hf_config.num_hidden_layers
    experts_share = expert * expert_tensor_parallel(tensor, expert)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    for name, size in _named_sizes(hf_config):
        if found := _LAYER.search(name):
            stage = int(found.group(1)) * pipeline // layers
            if ".experts." in name:
                counts[stage][1] += math.ceil(size / experts_share)
            else:
                counts[stage][0] += size if _whole_on_every_rank(name) else math.ceil(size / tensor)
        elif "lm_head" in name:
            if output_layer and not (tied and pipeline == 1):
                counts[-1][0] += math.ceil(size / tensor)
        elif "embed" in name:
            counts[0][0] += math.ceil(size / tensor)
        else:  # the final norm: on the last stage
            counts[-1][0] += size
    return [(dense, experts) for dense, experts in counts]


def _whole_on_every_rank(name: str) -> bool:
    """Tensors megatron-core does not split over tensor-parallel ranks: the norms and an MoE layer's router."""
    return "norm" in name or name.endswith(".mlp.gate.weight")


def _named_sizes(hf_config: Any) -> Iterable[tuple[str, int]]:
    """Each parameter of a transformers model of ``hf_config`` and its number of elements, from a model built on
    the meta device: exact for every architecture transformers knows, and nothing allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    names = {name for name, _ in model.named_parameters()}
    if "lm_head.weight" not in names:  # tied: transformers lists the shared tensor once, as the embedding's
        yield "lm_head.weight", model.get_output_embeddings().weight.numel()
    yield from ((name, param.numel()) for name, param in model.named_parameters())


def trainer_memory(config: Any, hf_config: Any, critic_hf_config: Any | None = None) -> TrainerMemory:
    """What :mod:`vime.gpu_memory` counts for the run of ``config`` (a :class:`vime.config.RunConfig`)."""
    job = config.job
    sizes = dict(tensor=job.tensor_model_parallel_size, pipeline=job.pipeline_model_parallel_size,
                 expert=job.expert_model_parallel_size)
    copies = _optimizer_copies(job) if job.use_distributed_optimizer else (1, 1)
    per_param = _bytes_per_parameter(config.model.dtype)
    policy = parameters_per_gpu(hf_config, **sizes)
    stages = [_state(dense, experts, per_param, copies) for dense, experts in policy]
    if job.algo == "ppo":
        critic = parameters_per_gpu(critic_hf_config or hf_config, **sizes, output_layer=False)
        stages = [state + _state(dense, experts, per_param, copies) for state, (dense, experts) in zip(stages, critic)]
    if config.loss.needs_reference:
        weight = per_param[0]
        stages = [state + (dense + experts) * weight for state, (dense, experts) in zip(stages, policy)]
    heaviest = max(range(len(stages)), key=stages.__getitem__)
    return TrainerMemory(parameters=sum(policy[heaviest]), experts=any(experts for _, experts in policy),
                         state_bytes=stages[heaviest])


def _bytes_per_parameter(dtype: str) -> tuple[int, int, int]:
    """(weight, gradient, masters and moments) bytes per trained parameter, as megatron-core keeps them."""
    return (2, 4, 12) if dtype == "bf16" else (4, 4, 8)


def _optimizer_copies(job: Any) -> tuple[int, int]:
    """Over how many ranks the distributed optimizer divides a dense tensor's state and an expert's."""
    data = job.data_parallel_size
    expert_data = (job.tensor_model_parallel_size * data) // (
        job.expert_model_parallel_size * expert_tensor_parallel(job.tensor_model_parallel_size,
                                                                job.expert_model_parallel_size))
    return data, max(1, expert_data)


def _state(dense: int, experts: int, per_param: tuple[int, int, int], copies: tuple[int, int]) -> int:
    """Bytes of ``dense`` and ``experts`` trained parameters; the optimizer's part divided over its copies as the
    elements are (rounded down: the count stays a lower bound)."""
    weight, gradient, optimizer = per_param
    return ((dense + experts) * (weight + gradient) + dense * optimizer // copies[0]
            + experts * optimizer // copies[1])


def engines_on_a_gpu(config: Any, placed: Any) -> int:
    """How many rollout engines stay awake through a training step on the trainer GPU that has the most: with
    ``--colocate`` and vLLM's sleep mode off, those ``placed`` (the run's :class:`vime.placement.Placement`) puts
    on it; else none."""
    if not config.placement.colocate or config.rollout.sleep_mode:
        return 0
    engines = [(devices or "").split(",") for devices in placed.engines]
    return max((sum(gpu in devices for devices in engines) for gpu in (placed.trainer or "").split(",") if gpu),
               default=0)


def check_fits(config: Any, placed: Any, hf_config: Any, card_bytes: int,
               critic_hf_config: Any | None = None) -> TrainerMemory:
    """The counted memory of one trainer GPU; a ValueError saying what to change when it is more than
    ``card_bytes``."""
    engines = engines_on_a_gpu(config, placed)
    share = float(config.rollout.vllm_args.get("gpu_memory_utilization", 0.9))  # vLLM's default
    counted = dataclasses.replace(trainer_memory(config, hf_config, critic_hf_config), engines=engines,
                                  engine_bytes=int(share * card_bytes) * engines)
    if counted.total <= card_bytes:
        return counted
    raise ValueError(_what_to_change(config, counted, card_bytes))


def _what_to_change(config: Any, counted: TrainerMemory, card_bytes: int) -> str:
    job = config.job
    said = (f"the trainer cannot fit its GPUs: each needs at least {counted.state_bytes / GIB:.1f} GiB for weights, "
            f"gradients and optimizer state ({counted.parameters / 1e9:.2f} B parameters of the policy on the "
            f"fullest GPU, {config.model.dtype})")
    if counted.engines:
        said += (f", beside the {counted.engine_bytes / GIB:.1f} GiB that {counted.engines} colocated vLLM "
                 f"engine(s) keep awake (--vllm-gpu-memory-utilization)")
    said += f", and the card has {card_bytes / GIB:.1f} GiB. Before activations, which come on top. Change: "
    ways = []
    if counted.engines and counted.state_bytes < card_bytes:
        ways.append("--vllm-enable-sleep-mode true (the engine gives its memory back for every training step)")
        room = math.floor((card_bytes - counted.state_bytes) / card_bytes / counted.engines * 100) / 100
        if room >= 0.05:
            ways.append(f"--vllm-gpu-memory-utilization {room:.2f} or less")
    if job.data_parallel_size > 1 and not job.use_distributed_optimizer:
        ways.append("--use-distributed-optimizer (divides masters and moments over the data-parallel copies)")
    parallel = "--tensor-model-parallel-size or --pipeline-model-parallel-size" + (
        ", or --expert-model-parallel-size" if counted.experts else "")
    ways.append(f"a larger {parallel} (more GPUs for the trainer: --actor-num-gpus-per-node, --actor-num-nodes)")
    if config.model.dtype != "bf16":
        ways.append("--dtype bf16")
    return said + "; or ".join(ways)


def card_bytes(gpu: str) -> int | None:
    """The memory of GPU ``gpu`` (an index as CUDA_VISIBLE_DEVICES names it) from nvidia-smi, which does not make
    a CUDA context in the driver (torch.cuda.get_device_properties would, on every GPU); None when it cannot say."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        shown = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", gpu],
                               capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(shown.split()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
