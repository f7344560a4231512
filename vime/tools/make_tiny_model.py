"""``python -m vime.tools.make_tiny_model``: a small random checkpoint of a real model family.

For machines without the real weights (CI, a laptop, tests): it writes a
Hugging Face folder -- config.json, model.safetensors, generation_config.json
and the tokenizer files -- whose architecture is that of the family
(Qwen3 dense; Qwen3-MoE with routed experts; GLM-4.5 MoE with a shared
expert and a dense first layer), at a size a 2-core CPU trains in seconds,
with the real tokenizer given. The embedding matrix is padded to a multiple
of 64 rows, as the real checkpoints pad theirs::

    python -m vime.tools.make_tiny_model --arch qwen3 --tokenizer ../shared/data/qwen3-tokenizer --out tiny-qwen3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ARCHS = ("qwen3", "qwen3_moe", "glm4_moe")


def tiny_config(arch: str, vocab_size: int, *, hidden_size: int = 64, layers: int = 2, **token_ids: Any) -> Any:
    """A transformers config of family ``arch`` at toy size; ``token_ids`` are pad/bos/eos ids."""
    import transformers

    heads = 4
    shared = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                  head_dim=hidden_size // heads, max_position_embeddings=4096, **token_ids)
    if arch == "qwen3":
        return transformers.Qwen3Config(**shared, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**shared, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=hidden_size // 2, decoder_sparse_step=1,
                                           norm_topk_prob=True)
    if arch == "glm4_moe":
        return transformers.Glm4MoeConfig(**shared, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                          moe_intermediate_size=hidden_size // 2, first_k_dense_replace=1,
                                          n_group=1, topk_group=1, use_qk_norm=True)
    raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, not {arch!r}")


def make_tiny_model(arch: str, tokenizer: str | Path, out: str | Path, *, seed: int = 0, hidden_size: int = 64,
                    layers: int = 2) -> Path:
    """Write the random checkpoint and the tokenizer to ``out``; returns it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder = Path(out)
    tokens = AutoTokenizer.from_pretrained(str(tokenizer))
    padded = -(-len(tokens) // 64) * 64
    eos = tokens.eos_token_id
    config = tiny_config(arch, padded, hidden_size=hidden_size, layers=layers, eos_token_id=eos,
                         pad_token_id=tokens.pad_token_id if tokens.pad_token_id is not None else eos,
                         bos_token_id=tokens.bos_token_id)
    torch.manual_seed(seed)
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, pad_token_id=config.pad_token_id).save_pretrained(folder)
    tokens.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.tools.make_tiny_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, choices=ARCHS, help="the model family")
    parser.add_argument("--tokenizer", required=True, help="a folder with the family's real tokenizer files")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    if not (Path(args.tokenizer) / "tokenizer_config.json").is_file():
        print(f"--tokenizer {args.tokenizer}: no tokenizer_config.json there; pass the folder of the real "
              "tokenizer files", file=sys.stderr)
        return 2
    folder = make_tiny_model(args.arch, args.tokenizer, args.out, seed=args.seed, hidden_size=args.hidden_size,
                             layers=args.layers)
    print(f"wrote a tiny random {args.arch} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
