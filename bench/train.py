"""Trainer throughput: tokens/s and MFU of one training step, Megatron backend against a plain HF trainer.

A step is forward + backward over ``--micro-batches`` micro-batches of random
tokens, gradient clipping and an AdamW update, with the loss the RL trainer
uses (mean of ``token_logprobs``, fp32 log-softmax over the vocabulary).
Weights are random, built from a Qwen3 config of the named shape: nothing is
downloaded. The MoE shapes (``tiny-moe``; ``30b-a3b-4l``, Qwen3-30B-A3B's
width at 4 of its 48 layers, which one GPU holds with its optimizer state)
count only the experts a token is routed to as its FLOPs, and routing is
whatever the random router weights decide. Each (shape, backend) runs in its own process, so one running out
of memory or failing to compile costs only its own row.

Backends:

* ``megatron`` -- ``vime.backends.megatron`` as the trainer runs it: a
  megatron-core GPTModel with the SDPA core attention, bf16 weights with fp32
  masters and fp32 gradient accumulation (``vime.backends.master_weights``),
  fused ``torch.optim.AdamW`` on the masters; no activation recomputation.
* ``megatron-compile`` -- the same, with ``torch.compile`` on each layer's MLP
  and norms and on the loss (fusing the SwiGLU and RMSNorm element-wise work
  and the fp32 log-softmax).
* ``hf`` -- what a TRL user gets: ``Qwen3ForCausalLM`` in bf16 with SDPA
  attention, gradient checkpointing and fused AdamW on the bf16 weights.

MFU = model FLOPs / step time / the bf16 matmul peak measured in the same run
(best short burst of square ``torch.matmul`` products), both as
``vime.flops`` counts them: 6 x matmul parameters per token (every linear
layer and the output projection; the input embedding is a lookup) + 6 x
layers x seq x heads x head_dim (causal attention, forward and backward);
recomputation is not counted.

With ``--mix dapo`` (or ``gsm8k``) the Megatron backends train samples of mixed lengths instead: DAPO-like
responses of 1k-8k tokens (mean ~4.6k) or GSM8K-like ones of 100-500, about four ``--max-tokens-per-gpu``
budgets of them a step, each in two layouts: ``padded`` (micro-batches of at most T tokens counted padded,
samples x the longest, every row padded to it: vime before packing) and ``packed`` (at most T real tokens, the
samples end to end in one row, attention within each: ``--use-dynamic-batch-size``). Tokens/s and MFU count
real tokens only. A packed row's attention is torch's variable-length flash kernel only where torch's takes a
causal window (``megatron.modules.document_attention``); an older torch attends through a mask as wide as the
whole row, which such a measurement would charge to packing: check ``_varlen_attention()`` on the machine first.

Usage::

    python bench/train.py --tiny                          # CPU check of the plumbing, seconds
    python bench/train.py --json bench/results/train-h200.json   # on the GPU: 0.6B and 4B at 4096
    python bench/train.py --shapes 4b --backends megatron hf --steps 6
    python bench/train.py --shapes 30b-a3b-4l --backends megatron hf --json bench/results/train-moe-h200.json
    python bench/train.py --profile ...                   # + GPU kernel time by kind (matmul, attention, ...)
    python bench/train.py --shapes 4b --backends megatron --mix dapo --json bench/results/train-packing-h200.json
    python bench/train.py --tiny --backends megatron --mix tiny   # CPU check of the packed/padded plumbing

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vime.backends.master_weights import MasterWeights
from vime.flops import matmul_parameters, matmul_peak_tflops, synchronize, training_flops

# Qwen3 shapes as their config.json give them (both have tied embeddings)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}
MOE_SHAPES = {"tiny-moe": None, "30b-a3b-4l": 4}  # Qwen3-MoE: layers of Qwen3-30B-A3B (None: a toy model)
# micro-batch size x micro-batches per step at the full sequence length: 16k tokens per optimizer step
BATCHING = {"tiny": (2, 2), "0.6b": (4, 1), "4b": (1, 4), "tiny-moe": (2, 2), "30b-a3b-4l": (1, 4)}
BACKENDS = ("megatron", "megatron-compile", "hf")
# --mix: (prompt tokens, response tokens), each drawn uniformly from its range (inclusive)
MIXES = {"dapo": ((100, 300), (1024, 8192)), "gsm8k": ((80, 200), (100, 500)), "tiny": ((4, 12), (1, 60))}
LAYOUTS = ("padded", "packed")


def qwen3_config(shape: str, seq_len: int) -> Any:
    from transformers import Qwen3Config

    from vime.devtools.make_tiny_model import full_config, tiny_config

    if shape in MOE_SHAPES:
        layers = MOE_SHAPES[shape]
        config = tiny_config("qwen3_moe", 512) if layers is None else full_config("qwen3-30b-a3b", layers)
        config.max_position_embeddings, config.use_cache = max(seq_len, config.max_position_embeddings), False
        return config
    return Qwen3Config(**SHAPES[shape], max_position_embeddings=max(seq_len, 40960), rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, attention_dropout=0.0,
                       use_cache=False)


def _loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The RL trainer's per-token log-probs (fp32 log-softmax over the vocabulary), averaged."""
    from vime.backends.hf import scaled_logprobs

    logprobs = scaled_logprobs(logits[:, :-1], 1.0)
    return -logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).mean()


def megatron_trainer(config: Any, device: str, compile_layers: bool) -> tuple[torch.nn.Module, Any, Any]:
    """The Megatron backend's model (random weights, bf16 with fp32 masters) and a micro-step function."""
    from vime.backends import megatron
    from vime.backends.hf import scaled_logprobs  # noqa: F401 -- imported before torch.compile traces _loss

    model = megatron.build_model(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
            else:
                param.fill_(1.0)
    loss_fn = _loss
    if compile_layers:
        for layer in model.decoder.layers:
            for module in (layer.mlp, layer.input_layernorm, layer.pre_mlp_layernorm,
                           layer.self_attention.q_layernorm, layer.self_attention.k_layernorm):
                module.compile()
        model.decoder.final_layernorm.compile()
        loss_fn = torch.compile(_loss)

    def micro_step(input_ids: torch.Tensor, scale: float, position_ids: torch.Tensor | None = None,
                   sample_lengths: torch.Tensor | None = None) -> float:
        """``position_ids`` and ``sample_lengths``: ``input_ids`` is one packed row (``megatron.forward``)."""
        loss = loss_fn(megatron.forward(model, input_ids, position_ids=position_ids,
                                        sample_lengths=sample_lengths).logits, input_ids) * scale
        loss.backward()
        return float(loss)

    return model, micro_step, "bf16 weights, fp32 masters and gradients, SDPA core attention, no recomputation"


def hf_trainer(config: Any, device: str) -> tuple[torch.nn.Module, Any, Any]:
    """The transformers model (Qwen3 or Qwen3-MoE) in bf16, SDPA attention, gradient checkpointing: a
    TRL-style trainer."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()

    def micro_step(input_ids: torch.Tensor, scale: float) -> float:
        logits = model(input_ids=input_ids).logits
        loss = _loss(logits, input_ids) * scale
        loss.backward()
        return float(loss)

    return model, micro_step, "bf16 weights, SDPA attention, gradient checkpointing"


# kernel-name fragments -> what the kernel does, for --profile (first match wins)
KERNEL_KINDS = (("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
                ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "matmul")),
                ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel")),
                ("loss", ("softmax", "log_softmax", "gather", "nll")))


def kernel_time_by_kind(step: Any, device: str) -> dict[str, float]:
    """Milliseconds of device kernels per kind over one profiled step (what the GPU spends its time on)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiler:
        step()
        synchronize(device)
    kernel_type = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    by_name: dict[str, float] = {}
    for event in profiler.events():
        if event.device_type == kernel_type:  # on CPU this double counts nested ops: plumbing only
            elapsed = event.device_time_total if device == "cuda" else event.cpu_time_total
            by_name[event.name] = by_name.get(event.name, 0.0) + elapsed / 1e3
    totals: dict[str, float] = {}
    for name, ms in by_name.items():
        kind = next((kind for kind, parts in KERNEL_KINDS if any(part in name.lower() for part in parts)), "other")
        totals[kind] = totals.get(kind, 0.0) + ms
    top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
    return {kind: round(ms, 1) for kind, ms in sorted(totals.items())} | {
        "top_kernels_ms": [(name[:100], round(ms, 1)) for name, ms in top]}


def mixed_micro_batches(mix: str, layout: str, max_tokens: int, vocab_size: int,
                        device: str) -> tuple[list[int], list[Any]]:
    """A step's sample lengths of ``mix`` (seeded: every step and both layouts train the same ones), about four
    budgets of ``max_tokens`` real tokens, and its micro-batches, longest first, as ``layout`` cuts them: each a
    function of a generator giving ``(input_ids, position_ids and sample lengths or None)``."""
    from vime.backends.torch_train import token_budget_sizes

    (prompts, responses), generator = MIXES[mix], torch.Generator().manual_seed(2)
    lengths: list[int] = []
    while sum(lengths) < 4 * max_tokens:
        lengths.append(sum(int(torch.randint(low, high + 1, (), generator=generator)) for low, high in (prompts,
                                                                                                      responses)))
    lengths.sort(reverse=True)
    if layout == "packed":
        sizes = token_budget_sizes(lengths, max_tokens)
    else:  # as many as fit padded (samples x the longest), one over-long sample alone
        sizes, start = [], 0
        while start < len(lengths):
            sizes.append(min(max(1, max_tokens // lengths[start]), len(lengths) - start))
            start += sizes[-1]
    batches, start = [], 0
    for size in sizes:
        chunk, start = lengths[start:start + size], start + size

        def make(generator: torch.Generator,
                 chunk: list[int] = chunk) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
            if layout == "packed":
                positions = torch.cat([torch.arange(length, device=device) for length in chunk]).unsqueeze(0)
                return (torch.randint(0, vocab_size, (1, sum(chunk)), device=device, generator=generator),
                        (positions, torch.tensor(chunk)))
            return torch.randint(0, vocab_size, (len(chunk), chunk[0]), device=device, generator=generator), None
        batches.append(make)
    return lengths, batches


def run_one(shape: str, backend: str, seq_len: int, steps: int, warmup: int, peak: float,
            profile_step: bool = False, mix: str | None = None, layout: str = "padded",
            max_tokens: int = 16384) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup`` of one backend at one shape; one result row. With ``mix``,
    of that length mix's samples in ``layout`` (:func:`mixed_micro_batches`), counting real tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = qwen3_config(shape, seq_len)
    if backend == "hf":
        model, micro_step, precision = hf_trainer(config, device)
    else:
        model, micro_step, precision = megatron_trainer(config, device, compile_layers=backend == "megatron-compile")
    masters = None if backend == "hf" else MasterWeights([model])
    params = masters.groups[0] if masters else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=device == "cuda")
    micro_batch_size, micro_batches = BATCHING[shape]
    generator = torch.Generator(device=device).manual_seed(1)
    if mix is None:
        lengths = [seq_len] * micro_batch_size * micro_batches
        batches = [lambda generator: (torch.randint(0, config.vocab_size, (micro_batch_size, seq_len), device=device,
                                                    generator=generator), None)] * micro_batches
    else:
        lengths, batches = mixed_micro_batches(mix, layout, max_tokens, config.vocab_size, device)

    def step() -> float:
        total = 0.0
        for make in batches:
            input_ids, packed = make(generator)
            total += (micro_step(input_ids, 1.0 / len(batches)) if packed is None else
                      micro_step(input_ids, 1.0 / len(batches), *packed))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if masters:
            masters.publish()
        return total

    losses, times = [], []
    for index in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        losses.append(round(step(), 4))
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    step_s = sum(times) / len(times)
    kernels = kernel_time_by_kind(step, device) if profile_step else None
    tokens = sum(lengths)  # real tokens: a padded row's padding is not counted, nor its FLOPs
    matmul_params, flops_per_token = matmul_parameters(config), training_flops(config, lengths) / tokens
    tflops = flops_per_token * tokens / step_s / 1e12
    mixed = {} if mix is None else dict(mix=mix, layout=layout, max_tokens_per_gpu=max_tokens, samples=len(lengths))
    return mixed | dict(
        shape=shape, backend=backend, seq_len=seq_len, tokens_per_s=round(tokens / step_s), mfu=round(tflops / peak, 4),
        tflops=round(tflops, 1), peak_tflops_measured=round(peak, 1), step_s=round(step_s, 4),
        micro_batch_size=micro_batch_size if mix is None else None, micro_batches=len(batches), steps=steps,
        warmup_steps=warmup,
        params=sum(param.numel() for param in model.parameters()), matmul_params=matmul_params,
        flops_per_token=flops_per_token, precision=precision, losses=losses,
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None,
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        **({"kernel_ms_by_kind": kernels} if kernels else {}))


def run_in_child(args: argparse.Namespace, shape: str, backend: str, peak: float,
                 layout: str = "padded") -> dict[str, Any]:
    """One row, computed in a fresh process."""
    command = [sys.executable, __file__, "--child", shape, backend, "--seq-len", str(args.seq_len),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--peak", str(peak)]
    if args.profile:
        command.append("--profile")
    identity = dict(shape=shape, backend=backend, seq_len=args.seq_len)
    if args.mix:
        command += ["--mix", args.mix, "--layout", layout, "--max-tokens-per-gpu", str(args.max_tokens_per_gpu)]
        identity |= dict(mix=args.mix, layout=layout)
    return row_from_child(command, args.timeout, identity)


def row_from_child(command: list[str], timeout: float, identity: dict[str, Any]) -> dict[str, Any]:
    """The row a child process prints (``RESULT {json}``), with its wall time. Each row runs in a fresh
    process for clean GPU memory; a crash, running out of memory or the time-out becomes the row's
    ``error``, beside ``identity``, instead of ending the bench."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(identity, error=f"timed out after {timeout} s")
    rows = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not rows:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        return dict(identity, error="\n".join(tail))
    return json.loads(rows[-1]) | {"wall_s": round(time.perf_counter() - started, 1)}


def keep_row(rows: list[dict[str, Any]], row: dict[str, Any], path: Path | None, **document: Any) -> None:
    """Add a measured row, print it (without per-step losses), and rewrite the JSON (``document`` and the rows)
    after every row, so that a run cut short keeps what it measured."""
    rows.append(row)
    print(json.dumps({key: value for key, value in row.items() if key != "losses"}), flush=True)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(document, torch=torch.__version__, command=" ".join(sys.argv), rows=rows),
                                   indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape at seq 64 on any device: checks the plumbing")
    parser.add_argument("--shapes", nargs="+", default=["0.6b", "4b"], choices=sorted([*SHAPES, *MOE_SHAPES]))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per (shape, backend)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more step and add its kernel time by kind to each row")
    parser.add_argument("--mix", choices=sorted(MIXES),
                        help="samples of this length mix, padded and packed (the Megatron backends only)")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384, metavar="T",
                        help="with --mix: a micro-batch's token budget (padded: samples x the longest; packed: real)")
    parser.add_argument("--layout", choices=LAYOUTS, default="padded", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=2, metavar=("SHAPE", "BACKEND"), help=argparse.SUPPRESS)
    parser.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    if args.child:
        print("RESULT " + json.dumps(run_one(*args.child, args.seq_len, args.steps, args.warmup, args.peak,
                                                  args.profile, args.mix, args.layout, args.max_tokens_per_gpu)),
              flush=True)
        return
    if args.mix and "hf" in args.backends:
        parser.error("--mix measures the Megatron backends' padded and packed layouts; the hf trainer has no packed "
                     "one here: pass --backends megatron (or megatron-compile)")
    if args.tiny:
        args.shapes, args.seq_len, args.steps, args.warmup = ["tiny", "tiny-moe"], 64, 2, 1
        if args.mix:
            args.max_tokens_per_gpu = min(args.max_tokens_per_gpu, 256)
        if not torch.cuda.is_available():
            args.backends = [backend for backend in args.backends if "compile" not in backend]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rates = matmul_peak_tflops(device)
    peak = max(rates.values())
    print(f"measured matmul peak: {peak:.1f} TFLOP/s ({'bf16' if device == 'cuda' else 'fp32, CPU'}; by size: "
          + ", ".join(f"{size}: {rate:.1f}" for size, rate in rates.items()) + ")", flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for shape in args.shapes:
        for backend in args.backends:
            for layout in LAYOUTS if args.mix else ("padded",):
                keep_row(rows, run_in_child(args, shape, backend, peak, layout), args.json,
                         peak_tflops_measured=round(peak, 1),
                         matmul_tflops_by_size={size: round(rate, 1) for size, rate in rates.items()})
    print(f"\n{'shape':6} {'backend':17} {'seq':>5} {'layout':>6} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} "
          f"{'step s':>7} {'mem GiB':>8}")
    for row in rows:
        where = f"{row['shape']:6} {row['backend']:17} {row['seq_len']:>5} {row.get('layout', '-'):>6}"
        if "error" in row:
            print(f"{where} failed: {row['error'].splitlines()[-1]}")
            continue
        print(f"{where} {row['tokens_per_s']:>9} {row['tflops']:>8} {row['mfu']:>6.1%} {row['step_s']:>7} "
              f"{row['peak_memory_gib'] or '-':>8}")


if __name__ == "__main__":
    main()
