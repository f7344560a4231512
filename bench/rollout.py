"""vime's vLLM rollout engine against bare vLLM, on one GPU, in one run.

Three measurements, each model shape in its own subprocess (a vLLM engine does not give all of
its memory back):

* generation: the same prompts, lengths and sampling through bare vLLM (``LLM.generate``, vLLM's
  defaults, asynchronous scheduling included) and through ``VllmRolloutEngine`` stepped the way
  the rollout worker steps it (per-token log-probs and versions kept, asynchronous scheduling off
  so that every token's version is exact) -- output tokens/s and the ratio;
* weight update: a full set of the model's weights (bf16, on the GPU) loaded into the engine by
  ``load_weights`` (in-process: tensors by reference) against a bare ``copy_`` of the same bytes;
* ``train_rollout_logprob_abs_diff``: vLLM (bf16) against a transformers forward (bf16, SDPA) over
  the same sequences with the same random weights (saved once, loaded by both).

Dummy random weights, Qwen3 shapes; random weights never emit EOS, so every response runs to its
length. Prints a table, writes JSON::

    python bench/rollout.py --models 0.6b,4b --json rollout.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=9728, tie_word_embeddings=False),
}
COMMON = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=128, vocab_size=151936,
              hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
              attention_bias=False, attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645,
              torch_dtype="bfloat16", initializer_range=0.02, use_cache=True)
VLLM = dict(gpu_memory_utilization=0.45, max_model_len=2048, attention_backend="FLASH_ATTN")


def _config_folder(shape: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"qwen3-{shape}-")
    config = dict(COMMON, **SHAPES[shape], max_window_layers=SHAPES[shape]["num_hidden_layers"])
    Path(folder, "config.json").write_text(json.dumps(config))
    return folder


def _prompts(count: int, length: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 151643, (count, length), generator=generator).tolist()


def bare(shape: str, args: argparse.Namespace) -> dict:
    """Bare vLLM: LLM.generate on token prompts, as a user of vLLM alone would call it."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=_config_folder(shape), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=args.prompts, seed=0, **VLLM)
    prompts = [{"prompt_token_ids": p} for p in _prompts(args.prompts, args.prompt_len)]
    params = SamplingParams(temperature=1.0, max_tokens=args.new, ignore_eos=True, logprobs=0, detokenize=False)
    llm.generate(prompts[:16], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"bare_gen_s": seconds, "bare_tokens_per_s": tokens / seconds}


def vime(shape: str, args: argparse.Namespace) -> dict:
    """vime's engine, stepped as the rollout worker steps it; then weight loads against a bare copy."""
    import torch

    from vime.backends.base import SamplingParams, Sequence
    from vime.backends.vllm_rollout import VllmRolloutEngine

    engine = VllmRolloutEngine(_config_folder(shape), dtype="bf16", max_batch_size=args.prompts,
                               engine_args=dict(load_format="dummy", **VLLM))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new)
    prompts = _prompts(args.prompts, args.prompt_len)

    def generate(count: int) -> tuple[float, int]:
        sequences = [Sequence(index, prompt, params) for index, prompt in enumerate(prompts[:count])]
        engine.add(sequences)
        start = time.perf_counter()
        while engine.busy:
            engine.step()
        return time.perf_counter() - start, sum(len(s.response_ids) for s in sequences)

    generate(16)  # warm-up
    seconds, tokens = generate(args.prompts)
    model = engine.engine.collective_rpc(lambda worker: worker.model_runner.model)[0]  # in-process
    weights = {name: torch.randn_like(p) * 0.02 for name, p in _hf_named_shapes(shape)}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    loads, copies = [], []
    for version in range(1, 4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.load_weights(weights, version)
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - start)
    targets = [p for p in model.parameters()]
    sources = [torch.empty_like(p) for p in targets]
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for target, source in zip(targets, sources):
            target.data.copy_(source)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    return {"vime_gen_s": seconds, "vime_tokens_per_s": tokens / seconds, "weights_gb": nbytes / 1e9,
            "vime_load_s": min(loads), "bare_copy_s": min(copies)}


def _hf_named_shapes(shape: str):
    """The checkpoint's (name, empty bf16 CUDA tensor) pairs, from a meta-device transformers model."""
    import torch
    import transformers

    config = transformers.Qwen3Config(**{k: v for k, v in dict(COMMON, **SHAPES[shape]).items()
                                         if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    return [(name, torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")) for name, p in model.named_parameters()]


def logprob_gap(shape: str, args: argparse.Namespace) -> dict:
    """vLLM bf16 against transformers bf16 on the same random weights and the same sequences."""
    import torch
    import transformers

    from vime.backends.base import SamplingParams, Sequence
    from vime.backends.vllm_rollout import VllmRolloutEngine

    config = transformers.Qwen3Config(**{k: v for k, v in dict(COMMON, **SHAPES[shape]).items()
                                         if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="qwen3-weights-")
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    engine = VllmRolloutEngine(folder, dtype="bf16", engine_args=VLLM)
    sequences = [Sequence(i, p, SamplingParams(temperature=1.0, max_new_tokens=args.gap_new))
                 for i, p in enumerate(_prompts(args.gap_prompts, args.prompt_len))]
    engine.add(sequences)
    while engine.busy:
        engine.step()
    model = model.cuda().eval()
    gaps = []
    with torch.no_grad():
        for s in sequences:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            reference = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids):, None]).squeeze(1)
            gaps.append((torch.tensor(s.logprobs, device="cuda") - reference).abs())
    every = torch.cat(gaps)
    return {"logprob_abs_diff_mean": float(every.mean()), "logprob_abs_diff_max": float(every.max()),
            "logprob_tokens": every.numel()}


PARTS = {"bare": bare, "vime": vime, "gap": logprob_gap}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="0.6b,4b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--gap-prompts", type=int, default=64)
    parser.add_argument("--gap-new", type=int, default=256)
    parser.add_argument("--gap-models", default="0.6b", help="shapes for the log-prob gap (weights are saved to disk)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("PART", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.one:
        part, shape = args.one
        print("RESULT " + json.dumps(PARTS[part](shape, args)), flush=True)
        return 0
    rows = []
    for shape in args.models.split(","):
        row = {"model": shape, "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new}
        for part in ("bare", "vime", *(("gap",) if shape in args.gap_models.split(",") else ())):
            command = [sys.executable, __file__, "--one", part, shape, *sys.argv[1:]]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if found:
                row.update(json.loads(found[0]))
            else:
                row[f"{part}_error"] = (done.stdout + done.stderr)[-3000:]
        if "vime_tokens_per_s" in row and "bare_tokens_per_s" in row:
            row["vime_over_bare"] = row["vime_tokens_per_s"] / row["bare_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ["model", "bare_tokens_per_s", "vime_tokens_per_s", "vime_over_bare", "weights_gb", "vime_load_s",
            "bare_copy_s", "logprob_abs_diff_mean", "logprob_abs_diff_max"]
    print("| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys)
              + " |")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
