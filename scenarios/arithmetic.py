"""arithmetic: a tiny random Qwen3 learns single-digit addition with RL alone.

The prompt is ``a+b=`` for digits with ``a + b <= 9``; the answer is the sum
as one digit, then the end-of-sequence token (two tokens). The reward is
exact match (``vime.rewards.exact``), so an answer counts only when the
model also stops. The model (2 layers, hidden 128, vocabulary of 16) and
its tokenizer are built from scratch in RUN_DIR/model with the run's seed:
at step 0 it answers at chance (2-3 % of answers are right, since a
random model rarely follows a digit with end-of-sequence); nothing is
downloaded and nothing is pre-trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vime.config import RunConfig

DESCRIPTION = "tiny random Qwen3 learns single-digit addition from scratch with GRPO or PPO on CPU"

_SYMBOLS = [str(d) for d in range(10)] + ["+", "="]
_SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]


def prompts() -> list[dict[str, Any]]:
    """Every problem once; the buffer shuffles them each epoch."""
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a in range(10) for b in range(10) if a + b <= 9]


def defaults() -> RunConfig:
    """The task's settings. ``clip_high`` 0.28 is DAPO's clip-higher: with PPO's 0.2 the policy's entropy
    collapsed before every prompt was learned and a few prompts stayed all wrong (advantage 0: never learned
    again) in sync and async runs alike (issue 30's matrix: 5 of 22 runs ended below 0.95, at 51-53 of the 55
    prompts). A higher ceiling lets a rare right answer grow faster than the wrong ones shrink: in the seeded
    harness of tests/test_learning.py at 150 steps, seed 1 sync 0.926 -> 0.998, seed 11 sync 0.956 -> 0.979,
    seed 1 two versions stale 0.962 -> 0.979."""
    config = RunConfig()
    return config.replace(custom_data_source="vime.scenarios.arithmetic:prompts", reward="exact",
                          rollout_batch_size=128, group_size=8, max_new_tokens=2, temperature=1.0,
                          lr=5e-4, critic_lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, updates_per_step=4,
                          micro_batch_size=256, steps=300, clip_high=0.28)


BUILDS = "a random tiny Qwen3 and its character-level tokenizer"  # what prepare builds without --model-path


def prepare(run_dir: Path, config: RunConfig) -> RunConfig:
    """Build the tokenizer and the random model in RUN_DIR/model (unless --model-path is given)."""
    if config.model.model_path:
        return config
    folder = Path(run_dir) / "model"
    build_model(folder, seed=config.job.seed)
    return config.replace(model_path=str(folder))  # responses stop at the tokenizer's EOS (the buffer's default)


def build_model(folder: Path, *, seed: int, hidden_size: int = 128, layers: int | None = None, arch: str = "qwen3",
                shape: str = "", tied_embeddings: bool | None = None) -> int:
    """Write a random tiny Qwen3 (``arch`` qwen3_moe: Qwen3-MoE) and its character-level tokenizer to
    ``folder``; returns the eos id. ``shape`` (``qwen3-0.6b``, ``qwen3-30b-a3b``: ``make_tiny_model.SHAPES``)
    builds a real model's width and depth (``layers`` cuts the depth) over the same 16-token vocabulary, in
    bf16 as the real checkpoints are stored: the task at a size where GPU kernels, conversion and weight
    paths run as they do for real models, with the same start at chance. ``tied_embeddings`` overrides whether
    the output layer shares the embedding's weight (tiny: not tied; a shape: as published)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from vime.devtools.make_tiny_model import full_config, tiny_config

    vocab = {token: index for index, token in enumerate(_SPECIAL + _SYMBOLS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(folder)
    token_ids = dict(pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"])
    if shape:
        config = full_config(shape, layers, vocab_size=len(vocab), **token_ids)
    else:
        config = tiny_config(arch, len(vocab), hidden_size=hidden_size, layers=layers or 2, **token_ids)
    if tied_embeddings is not None:
        config.tie_word_embeddings = tied_embeddings
    torch.manual_seed(seed)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if shape else None)
    model.save_pretrained(folder)
    return vocab["</s>"]
