r"""One MoE layer's routed experts, forward and backward: megatron-core's SequentialMLP against vime's GroupedExperts.

Both hold the same weights (copied from one to the other) and get the same
routed tokens: ``--tokens`` tokens, each sent to ``num_experts_per_tok``
distinct experts drawn at random, sorted by expert, with the counts per
expert on the host, as megatron-core's token dispatchers hand them over. Per implementation, over
``--steps`` timed steps after a
warm-up: the median time of forward plus backward, and the matmul TFLOP/s
it reaches (forward 2 x rows x 3 x hidden x ffn FLOPs, backward twice
that). The outputs of the two are compared as a check. On a GPU the weights
are bf16, as the trainer holds them; on CPU fp32.

Usage::

    python bench/experts.py --shape qwen3-30b-a3b --tokens 16384 --json bench/results/experts-h200.json
    python bench/experts.py --shape qwen3-30b-a3b --tokens 256 --steps 2   # CPU: a smoke run

It measures; it decides nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vime.devtools.make_tiny_model import SHAPES, full_config


def routed_tokens(tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype,
                  device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden states [tokens * top_k, hidden] sorted by expert, tokens per expert, probabilities)``."""
    generator = torch.Generator().manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=generator).argsort(-1)[:, :top_k].flatten()
    per_expert = torch.bincount(chosen, minlength=experts)
    states = torch.randn(chosen.numel(), hidden, generator=generator).to(dtype=dtype, device=device)
    probs = torch.rand(chosen.numel(), generator=generator).to(device)
    return states, per_expert.pin_memory() if device == "cuda" else per_expert, probs  # on the host, as dispatched


def timed(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], steps: int, warmup: int) -> tuple[list[float],
                                                                                                       torch.Tensor]:
    """Seconds of each forward + backward after ``warmup`` untimed ones, and the last output."""
    states, per_expert, probs = inputs
    times = []
    for step in range(warmup + steps):
        states.grad = None
        module.zero_grad(set_to_none=True)
        if states.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        output, _ = module(states, per_expert, probs)
        output.backward(torch.ones_like(output))
        if states.is_cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times, output.detach()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=[s for s, (arch, _) in SHAPES.items()
                                                                     if arch == "qwen3_moe"])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens routed through the layer")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from vime.backends import megatron

    cuda = torch.cuda.is_available()
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    hf_config = full_config(args.shape, 1)
    megatron.init_parallel(1)
    config = megatron.transformer_config(hf_config, params_dtype=dtype)
    groups = ProcessGroupCollection.use_mpu_process_groups()
    count, top_k = hf_config.num_experts, hf_config.num_experts_per_tok
    sequential = SequentialMLP(count, config, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear), pg_collection=groups)
    grouped = megatron.GroupedExperts(count, config, pg_collection=groups)
    with torch.no_grad():
        for expert, mlp in enumerate(sequential.to(device).local_experts):
            for layer in (mlp.linear_fc1, mlp.linear_fc2):
                layer.weight.normal_(0, 0.02)
            grouped.linear_fc1.weight[expert].copy_(mlp.linear_fc1.weight)
            grouped.linear_fc2.weight[expert].copy_(mlp.linear_fc2.weight)
    states, per_expert, probs = routed_tokens(args.tokens, count, top_k, hf_config.hidden_size, dtype, device)
    flops = 3 * 2 * states.shape[0] * 3 * hf_config.hidden_size * hf_config.moe_intermediate_size
    rows: list[dict[str, Any]] = []
    outputs = {}
    for name, module in (("sequential", sequential), ("grouped", grouped)):
        times, outputs[name] = timed(module, (states.detach().requires_grad_(), per_expert, probs), args.steps,
                                     args.warmup)
        median = statistics.median(times)
        rows.append({"experts": name, "step_s": round(median, 5), "times_s": [round(t, 5) for t in times],
                     "tflops": round(flops / median / 1e12, 1)})
    base = rows[0]["step_s"]
    for row in rows:
        row["speedup"] = round(base / row["step_s"], 2)
    gap = (outputs["grouped"].float() - outputs["sequential"].float()).abs().max().item()
    print(f"{args.shape}: {count} experts, top {top_k}, {args.tokens} tokens ({states.shape[0]} routed rows), "
          f"{dtype}, {torch.cuda.get_device_name() if cuda else 'CPU'}; outputs differ by at most {gap:.2e}")
    print(f"{'experts':<12} {'fwd+bwd s':>10} {'TFLOP/s':>8} {'speedup':>8}")
    for row in rows:
        print(f"{row['experts']:<12} {row['step_s']:>10.5f} {row['tflops']:>8.1f} {row['speedup']:>8.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__,
            "shape": args.shape, "tokens": args.tokens, "routed_rows": states.shape[0], "dtype": str(dtype),
            "max_abs_output_gap": gap, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
