"""The trainer's own step on an RL batch: seconds per step, tokens/s and peak memory of
``TrainEngine.train_step`` as the trainer actor runs it, one row per (estimator, micro-batch size), side by side.

``bench/train.py`` times the model's forward and backward at one sequence length. This times what a
pipeline step does around them: right-padded samples of varying prompt length, cut into micro-batches
of similar length, the log-prob and entropy of every response token over the whole vocabulary, the
policy loss, clipping and AdamW on fp32 masters. The batch is ``--samples`` responses of
``--response-len`` tokens after prompts of ``--prompt-len`` tokens (``MIN:MAX``, uniform), random token
ids, rewards of 1 and 0 by turns (so advantages are not zero), ``--updates-per-step`` optimizer steps (1, as in
the TRL-settings runs: the training pass's log-probs are the old ones, so there is no scoring pass); the
model is the one at ``--model-path``
(a random full-size Qwen3 from ``python -m vime.devtools.make_tiny_model --shape ...``). ``--algos grpo ppo``
times each micro-batch size under both estimators: PPO's step adds the value model's pass before the update (its
values, for GAE) and its training in each mini-batch, a second model of the policy's shape with its own AdamW
state (``--critic-model-path`` left out). Each (estimator, micro-batch size) runs in a process of its own:
running out of memory costs only its row.

Usage::

    python bench/train_step.py --tiny        # CPU check of the plumbing: a tiny random model, seconds
    python bench/train_step.py --model-path /root/m06 --samples 512 --prompt-len 60:194 \\
        --response-len 512 --micro-batch-sizes 16 32 --profile --json $OUT/train-step.json   # TRL's shapes
    python bench/train_step.py --model-path /root/m06 --micro-batch-sizes 16 --algos grpo ppo   # PPO beside GRPO

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vime.backends.base import TensorBatch, collate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import keep_row, kernel_time_by_kind, row_from_child  # noqa: E402 -- bench/train.py, beside this file


def rl_batch(samples: int, prompt_len: tuple[int, int], response_len: int, vocab: int,
             seed: int = 0) -> TensorBatch:
    """A collated batch of random prompts and responses, groups of 8, rewards 1 and 0 by turns."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(samples)]
    responses = [[rng.randrange(vocab) for _ in range(response_len)] for _ in range(samples)]
    return collate(prompts, responses, [[-1.0] * response_len] * samples, [[0] * response_len] * samples,
                   [float(index % 2) for index in range(samples)], [index // 8 for index in range(samples)],
                   pad_token_id=0)


def padded_tokens(batch: TensorBatch, micro_batch_size: int) -> int:
    """Token positions the forward computes: each micro-batch is as wide as its longest sample (one update per
    step: with more, micro-batches form inside each random mini-batch and a scoring pass comes first)."""
    from vime.backends.torch_train import micro_batches

    lengths = batch.attention_mask.sum(-1)
    rows = torch.arange(len(lengths))
    return sum(len(part) * int(lengths[part].max()) for part in micro_batches(rows, lengths, micro_batch_size))


def run_one(args: argparse.Namespace, algo: str, micro_batch_size: int) -> dict[str, Any]:
    """Time ``--steps`` train steps after ``--warmup`` at one estimator and micro-batch size; one result row."""
    from vime.backends import train_engine
    from vime.config import RunConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = RunConfig().replace(model_path=str(args.model_path), train_backend="megatron", dtype=args.dtype, algo=algo,
                              micro_batch_size=micro_batch_size, updates_per_step=args.updates_per_step,
                              steps=args.warmup + args.steps + 1)
    engine = train_engine(run, seed=0)
    batch = rl_batch(args.samples, args.prompt_len, args.response_len, engine.hf_config.vocab_size)

    def step() -> None:
        engine.train_step(batch)
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    for index in range(args.warmup + args.steps):
        started = time.perf_counter()
        step()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    tokens = int(batch.attention_mask.sum())
    return dict(
        algo=algo, micro_batch_size=micro_batch_size, step_s=round(step_s, 3),
        step_times_s=[round(t, 3) for t in times],
        tokens=tokens, tokens_per_s=round(tokens / step_s), padded_tokens=padded_tokens(batch, micro_batch_size),
        peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device == "cuda" else None,
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        **({"kernel_ms_by_kind": kernel_time_by_kind(step, device)} if args.profile else {}))


def run_in_child(args: argparse.Namespace, algo: str, micro_batch_size: int) -> dict[str, Any]:
    """One row, computed in a fresh process."""
    command = [sys.executable, __file__, "--child", algo, str(micro_batch_size), "--model-path", str(args.model_path),
               "--samples", str(args.samples), "--prompt-len", f"{args.prompt_len[0]}:{args.prompt_len[1]}",
               "--response-len", str(args.response_len), "--dtype", args.dtype, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--updates-per-step", str(args.updates_per_step)] + (
                  ["--profile"] if args.profile else [])
    return row_from_child(command, args.timeout, dict(algo=algo, micro_batch_size=micro_batch_size))


def span(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (or one number) as a pair."""
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, help="a Hugging Face Qwen3 folder (random weights will do)")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random model, batch and fp32 in place of the model, sizes and dtype given")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--prompt-len", type=span, default=(60, 194), help="MIN:MAX tokens, uniform")
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--algos", nargs="+", default=["grpo"], choices=["grpo", "ppo"],
                        help="advantage estimators to time, each at every micro-batch size")
    parser.add_argument("--updates-per-step", type=int, default=1)
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per micro-batch size")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one more step and add its kernel time by kind to each row")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("ALGO", "MICRO_BATCH_SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    if args.child is not None:
        print("RESULT " + json.dumps(run_one(args, args.child[0], int(args.child[1]))), flush=True)
        return
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            from vime.scenarios.arithmetic import build_model

            args.model_path = Path(scratch) / "model"
            build_model(args.model_path, seed=0)
            args.samples, args.prompt_len, args.response_len, args.micro_batch_sizes = 16, (4, 12), 8, [4, 8]
            args.dtype = "fp32"
        if args.model_path is None:
            parser.error("give --model-path (or --tiny)")
        rows: list[dict[str, Any]] = []
        for algo, size in itertools.product(args.algos, args.micro_batch_sizes):
            keep_row(rows, run_in_child(args, algo, size), args.json, samples=args.samples,
                     prompt_len=list(args.prompt_len), response_len=args.response_len, dtype=args.dtype)
    print(f"\n{'algo':>5} {'micro-batch':>11} {'step s':>7} {'tokens/s':>9} {'padded/real':>11} {'mem GiB':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['algo']:>5} {row['micro_batch_size']:>11} failed: {row['error'].splitlines()[-1]}")
            continue
        print(f"{row['algo']:>5} {row['micro_batch_size']:>11} {row['step_s']:>7} {row['tokens_per_s']:>9} "
              f"{row['padded_tokens'] / row['tokens']:>11.3f} {row['peak_memory_gib'] or '-':>8}")


if __name__ == "__main__":
    main()
