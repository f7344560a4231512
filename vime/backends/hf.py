"""Hugging Face model folders, and the log-prob math both torch engines share.

Rollout and trainer compute per-token log-probs with the same function on
the same model class, so that in fp32 they agree to float rounding
(``train_rollout_logprob_abs_diff``).
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_model_folder(path: str | Path) -> Path:
    """The folder, or a ValueError saying what is missing and what to pass instead."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model-path {folder} has no config.json; pass a Hugging Face model folder "
                         "(config.json, *.safetensors, tokenizer files)")
    return folder


def load_causal_lm(path: str | Path, dtype: str = "fp32") -> torch.nn.Module:
    """The causal LM in ``path`` with its weights in ``dtype``, in eval mode (no dropout)."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(check_model_folder(path), dtype=DTYPES[dtype])
    return model.eval()


def load_tokenizer(path: str | Path):
    """The tokenizer saved with the model (tokenizer.json / tokenizer_config.json)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(check_model_folder(path))


def scaled_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log-softmax of ``logits / temperature`` in fp32: the distribution both sides report."""
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.to(torch.float32).view(-1, *([1] * (logits.dim() - 1)))
    return torch.log_softmax(logits.to(torch.float32) / temperature, dim=-1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left- and right-padded rows see the same RoPE angles."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
