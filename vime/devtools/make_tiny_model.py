"""``python -m vime.devtools.make_tiny_model``: a small random checkpoint of a real model family.

For machines without the real weights (CI, a laptop, tests): it writes a
Hugging Face folder -- config.json, model.safetensors, generation_config.json
and the tokenizer files -- whose architecture is that of the family
(Qwen3 dense; Qwen3-MoE with routed experts; GLM-4.5 MoE with a shared
expert and a dense first layer), at a size a 2-core CPU trains in seconds,
with the real tokenizer given. The embedding matrix is padded to a multiple
of 64 rows, as the real checkpoints pad theirs::

    python -m vime.devtools.make_tiny_model --arch qwen3 --tokenizer ../shared/data/qwen3-tokenizer --out tiny-qwen3

``--shape`` writes a real model's full shape instead (``qwen3-0.6b``,
``qwen3-4b``, ``qwen3-30b-a3b``: their published configs, vocabulary of
151,936 included), for benchmarks where the real weights cannot be had;
build it on a GPU in bf16 (``--device cuda --dtype bf16``), as the real
checkpoints are stored. ``--layers`` with ``--shape`` keeps the real width
and cuts the depth, to try a big model's layout on fewer GPUs::

    python -m vime.devtools.make_tiny_model --arch qwen3 --shape qwen3-4b --device cuda --dtype bf16 \
        --tokenizer qwen3-tokenizer --out qwen3-4b-random
    python -m vime.devtools.make_tiny_model --arch qwen3_moe --shape qwen3-30b-a3b --layers 4 --device cuda \
        --dtype bf16 --tokenizer qwen3-tokenizer --out qwen3-30b-a3b-4-layers
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ARCHS = ("qwen3", "qwen3_moe", "glm4_moe")
# The published configs (Qwen/Qwen3-0.6B, Qwen/Qwen3-4B, Qwen/Qwen3-30B-A3B): what --shape builds, random weights
# aside, as (family, the settings that differ between them)
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-4b": ("qwen3", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, tie_word_embeddings=True)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                        num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
}


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


def full_config(shape: str, layers: int | None = None, vocab_size: int = 151936, **token_ids: Any) -> Any:
    """The transformers config of a real model's shape (``SHAPES``), with ``layers`` decoder layers if given and
    a vocabulary of ``vocab_size`` (the real one's by default); ``token_ids`` are pad/bos/eos ids."""
    import transformers

    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, not {shape!r}")
    arch, settings = SHAPES[shape]
    config_class = transformers.Qwen3Config if arch == "qwen3" else transformers.Qwen3MoeConfig
    depth = {} if layers is None else {"num_hidden_layers": layers}
    return config_class(**{**settings, **depth}, vocab_size=vocab_size, head_dim=128, max_position_embeddings=40960,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, **token_ids)


def make_tiny_model(arch: str, tokenizer: str | Path, out: str | Path, *, seed: int = 0, hidden_size: int = 64,
                    layers: int | None = None, shape: str = "", dtype: str = "fp32", device: str = "cpu") -> Path:
    """Write the random checkpoint and the tokenizer to ``out``; returns it. With ``shape``, a real model's full
    shape (``arch`` must be its family; ``layers``, if given, its depth), built on ``device`` in ``dtype``
    (fp32 or bf16); without, a tiny one of ``layers`` (default 2)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from vime.backends.hf import DTYPES

    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be at least 1, not {layers}")
    if shape in SHAPES and arch != SHAPES[shape][0]:
        raise ValueError(f"--shape {shape} is a {SHAPES[shape][0]} model: pass --arch {SHAPES[shape][0]}")
    folder = Path(out)
    tokens = AutoTokenizer.from_pretrained(str(tokenizer))
    eos = tokens.eos_token_id
    token_ids = dict(eos_token_id=eos, pad_token_id=tokens.pad_token_id if tokens.pad_token_id is not None else eos,
                     bos_token_id=tokens.bos_token_id)
    config = full_config(shape, layers, **token_ids) if shape else \
        tiny_config(arch, -(-len(tokens) // 64) * 64, hidden_size=hidden_size,
                    layers=2 if layers is None else layers, **token_ids)
    torch.manual_seed(seed)
    transformers.utils.logging.disable_progress_bar()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    GenerationConfig(eos_token_id=eos, pad_token_id=config.pad_token_id).save_pretrained(folder)
    tokens.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vime.devtools.make_tiny_model",
                                     description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--arch", required=True, choices=ARCHS, help="the model family")
    parser.add_argument("--tokenizer", required=True, help="a folder with the family's real tokenizer files")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: 2, or the --shape's own number)")
    parser.add_argument("--shape", default="", choices=["", *SHAPES],
                        help="a real model's shape instead of a tiny one (--hidden-size ignored)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights' dtype")
    parser.add_argument("--device", default="cpu", help="where to build the model (cuda: much faster at full size)")
    args = parser.parse_args(argv)
    if not (Path(args.tokenizer) / "tokenizer_config.json").is_file():
        print(f"--tokenizer {args.tokenizer}: no tokenizer_config.json there; pass the folder of the real "
              "tokenizer files", file=sys.stderr)
        return 2
    try:
        folder = make_tiny_model(args.arch, args.tokenizer, args.out, seed=args.seed, hidden_size=args.hidden_size,
                                 layers=args.layers, shape=args.shape, dtype=args.dtype, device=args.device)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote a random {args.shape or 'tiny ' + args.arch} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
