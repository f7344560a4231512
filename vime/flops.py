"""Model FLOPs of training, and the matmul peak a GPU reaches: what MFU is made of.

Counted as the scaling literature counts them: 6 x the matmul parameters a token goes through (forward and
backward), plus causal attention (6 x layers x sequence length x heads x head_dim per token). The input
embedding is a lookup and is not counted; an MoE layer counts its router, its shared experts and the
``num_experts_per_tok`` experts a token is routed to. Work done twice is not counted: the trainer's pass that
recomputes the old log-probs, or recomputed activations. The trainer reports ``train_tflops_per_gpu`` from
these; ``bench/e2e.py`` and ``bench/train.py`` divide by :func:`matmul_peak_tflops` for the MFU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from vime.architecture import head_dim, moe_layer_pattern, routed_experts


def matmul_parameters(hf_config: Any) -> int:
    """The matmul parameters one token goes through: every layer's attention and (routed) MLP, and the output
    projection."""
    hidden, heads, groups = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    attention = hidden * (heads + 2 * groups) * head_dim(hf_config) + heads * head_dim(hf_config) * hidden
    dense = 3 * hidden * hf_config.intermediate_size
    total = hf_config.vocab_size * hidden
    for moe in moe_layer_pattern(hf_config):
        total += attention
        if not moe:
            total += dense
            continue
        experts = routed_experts(hf_config)
        per_expert = 3 * hidden * hf_config.moe_intermediate_size
        shared = getattr(hf_config, "n_shared_experts", 0) or 0
        total += (hf_config.num_experts_per_tok + shared) * per_expert + hidden * experts
    return total


def training_flops(hf_config: Any, lengths: Iterable[int]) -> float:
    """Model FLOPs of one forward and backward pass over sequences of ``lengths`` tokens (padding excluded)."""
    per_token = 6 * matmul_parameters(hf_config)
    attention = 6 * hf_config.num_hidden_layers * hf_config.num_attention_heads * head_dim(hf_config)
    return float(sum(per_token * length + attention * length * length for length in lengths))


def matmul_peak_tflops(device: str) -> dict[int, float]:
    """The bf16 matmul rate (TFLOP/s) of square products of a few sizes: the best of short bursts.

    MFU is taken against the best of them. Bursts of about 50 ms, not a
    sustained run: a second of back-to-back matmuls drops the clocks to the
    power limit (about 670 TFLOP/s on an H200, against about 780 for the
    same kernels inside a training step, where other work lets the clocks
    recover), and a low peak would flatter the MFU. On CPU the product is
    fp32 and small (plumbing only).
    """
    sizes, dtype = ((4096, 8192, 16384), torch.bfloat16) if device == "cuda" else ((512,), torch.float32)
    rates = {}
    for size in sizes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        repeats = max(2, int(5e13 / (2 * size**3))) if device == "cuda" else 3  # ~50 ms at 1 PFLOP/s
        best = 0.0
        for _ in range(8):
            synchronize(device)
            time.sleep(0.2)  # let the clocks recover, as they do between a training step's matmuls
            start = time.perf_counter()
            for _ in range(repeats):
                torch.matmul(a, b)
            synchronize(device)
            best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12)
        rates[size] = best
        del a, b
    return rates


def synchronize(device: str) -> None:
    """Wait for the work queued on ``device``: a GPU timing starts and ends here."""
    if device == "cuda":
        torch.cuda.synchronize()
