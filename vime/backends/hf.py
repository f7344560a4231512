"""Hugging Face model folders, and the log-prob math both torch engines share.

Rollout and trainer compute per-token log-probs with the same function on
the same model class, so that in fp32 they agree to float rounding
(``train_rollout_logprob_abs_diff``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_model_folder(path: str | Path, *, tokenizer: bool = True, weights: bool = True,
                       flag: str = "--model-path") -> Path:
    """The folder, or a ValueError naming what is missing and what to pass instead
    (a trainer's own checkpoint folder holds the model without a tokenizer; ``weights=False``: a dry run reads
    config.json and the tokenizer only, so a folder without the weights will do). ``flag``: the setting that
    named the folder, for the message."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{flag} {folder}: no such folder; pass a local Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files); nothing is downloaded")
    missing = [what for what, present in (
        ("config.json", (folder / "config.json").is_file()),
        ("weights (*.safetensors)", not weights or any(folder.glob("*.safetensors"))),
        ("tokenizer (tokenizer.json or tokenizer_config.json)", not tokenizer
         or (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()),
    ) if not present]
    if missing:
        raise ValueError(f"{flag} {folder} has no {', no '.join(missing)}; pass a Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files), or make a tiny stand-in with "
                         "python -m vime.devtools.make_tiny_model")
    return folder


def check_critic_vocabulary(policy_path: str | Path, critic_path: str | Path) -> None:
    """ValueError, before a run, when PPO's value model from ``critic_path`` (``--critic-model-path``) cannot
    read the policy's token ids: it is fed them as they are, so its embedding needs every id the policy can
    sample (on one rank a larger id is an index error; split over tensor-parallel ranks, an id past the
    vocabulary embeds as zeros and gives values silently wrong), and, where the folder has a tokenizer, the
    same one (an id must mean the same token to both)."""
    from transformers import AutoConfig

    policy, critic = (AutoConfig.from_pretrained(path).get_text_config().vocab_size
                      for path in (policy_path, critic_path))
    if critic < policy:
        raise ValueError(f"--critic-model-path {critic_path} has a vocabulary of {critic} tokens, fewer than the "
                         f"{policy} of --model-path {policy_path}, whose token ids it is given: pass a value model "
                         "with the policy's tokenizer, or leave --critic-model-path out")
    critic_folder = Path(critic_path)
    if (critic_folder / "tokenizer.json").is_file() or (critic_folder / "tokenizer_config.json").is_file():
        if load_tokenizer(critic_folder).get_vocab() != load_tokenizer(policy_path).get_vocab():
            raise ValueError(f"--critic-model-path {critic_path} has a tokenizer other than --model-path "
                             f"{policy_path}'s, whose token ids it is given: pass a value model with the "
                             "policy's tokenizer, or leave --critic-model-path out")


def stop_token_ids(path: str | Path, tokenizer: Any) -> list[int]:
    """The ids a response of this model ends at: the tokenizer's EOS and generation_config.json's
    ``eos_token_id`` (GLM-4.5 and Qwen3 list several there)."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        declared = json.loads(generation.read_text()).get("eos_token_id")
        ids += declared if isinstance(declared, list) else [] if declared is None else [declared]
    return sorted(set(ids))


def load_causal_lm(path: str | Path, dtype: str = "fp32") -> torch.nn.Module:
    """The causal LM in ``path`` with its weights in ``dtype``, in eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(check_model_folder(path, tokenizer=False), dtype=DTYPES[dtype])
    return model.eval()


def warn_if_bf16_is_emulated(dtype: str, device: str) -> None:
    """Warn, as a torch engine is built, that ``--dtype bf16`` on this CPU will be slow: where oneDNN cannot
    multiply bf16 (x86 without AVX-512 or AMX, Arm without its bf16 instructions) torch falls back to a slow
    path, which made a step of the tests' tiny Qwen3 (a 151,680-token output layer) 10 times longer than in fp32
    on CI's AVX2 CPU. The run is still right; nothing else would tell its user why it crawls."""
    if dtype == "bf16" and torch.device(device).type == "cpu" and not cpu_multiplies_bf16():
        structlog.get_logger().warning("--dtype bf16 on a CPU that cannot multiply bf16 (no AVX-512 or AMX; on Arm, "
                                       "no bf16 instructions): torch emulates it, several times slower than fp32; "
                                       "pass --dtype fp32 for CPU runs", device=device)


def cpu_multiplies_bf16() -> bool:
    """Whether torch's bf16 matrix products run on oneDNN here: the check torch makes itself before taking that
    path. True where this torch cannot say (no warning without evidence)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return True if check is None else bool(check())


def load_tokenizer(path: str | Path):
    """The tokenizer saved with the model (tokenizer.json / tokenizer_config.json); the weights need not be there."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_folder(path, weights=False))


def in_memory_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named weights as transformers holds them in memory: since transformers 5, MoE experts
    live fused (``experts.gate_up_proj [experts, 2 x ffn, hidden]``, ``experts.down_proj``) while a
    checkpoint -- and a trainer that writes one, like the Megatron backend -- names them one by one."""
    experts = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    fused: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    named = {}
    for name, tensor in tensors.items():
        match = experts.match(name)
        if match is None:
            named[name] = tensor
        else:
            fused.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for prefix, by_expert in fused.items():
        order = [by_expert[index] for index in sorted(by_expert)]
        named[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate"], e["up"]]) for e in order])
        named[f"{prefix}.down_proj"] = torch.stack([e["down"] for e in order])
    return named


def checkpoint_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`in_memory_names`: fused MoE experts split one by one, as a checkpoint (and
    vLLM's loader) names them; every other tensor passes unchanged."""
    fused = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")
    named = {}
    for name, tensor in tensors.items():
        match = fused.match(name)
        if match is None:
            named[name] = tensor
            continue
        for index, expert in enumerate(tensor.unbind(0)):
            prefix = f"{match[1]}.{index}"
            if match[2] == "down_proj":
                named[f"{prefix}.down_proj.weight"] = expert
            else:
                gate, up = expert.chunk(2)
                named[f"{prefix}.gate_proj.weight"], named[f"{prefix}.up_proj.weight"] = gate, up
    return named


def scaled_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log-softmax of ``logits / temperature`` in fp32: the distribution both sides report.

    At temperature 1 the softmax itself reads bf16 logits and computes in fp32: on a GPU no fp32 copy of the
    ``[..., vocab]`` logits is made, nor divided, nor cast back in the backward pass (the division alone took
    0.23 s of the 7.82 s of kernels in a 0.6B training step: bench/RESULTS.md)."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float32).view(-1, *([1] * (logits.dim() - 1)))
    elif temperature == 1.0:
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    return torch.log_softmax(logits.to(torch.float32) / temperature, dim=-1)


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``log p(targets)`` and the entropy at every position of ``logits [..., vocab]`` under
    ``softmax(logits / temperature)`` in fp32: what ``scaled_logprobs`` gives, without its ``[..., vocab]`` fp32
    result. On a GPU it runs compiled, so the upcast, scaling, log-sum-exp and entropy read the logits in
    one pass and their backward writes the logits' gradient in another, instead of an eager chain of
    vocabulary-wide fp32 copies: a Qwen3-0.6B training step on an H200 takes 4-10 % less time and 14-16 %
    less memory (bench/RESULTS.md). ``entropy_grad`` False: the entropy is a metric (no gradient)."""
    if logits.is_cuda:
        return _compiled_token_stats()(logits, targets, temperature, entropy_grad)
    return _token_stats(logits, targets, temperature, entropy_grad)


def _token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                 entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float() / temperature
    normalizer = torch.logsumexp(scaled, dim=-1)
    chosen = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    if not entropy_grad:
        scaled, normalizer = scaled.detach(), normalizer.detach()
    entropy = normalizer - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return chosen, entropy


@functools.cache
def _compiled_token_stats() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Compiled once per process, for any batch and sequence length."""
    return torch.compile(_token_stats, dynamic=True)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left- and right-padded rows see the same RoPE angles."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
