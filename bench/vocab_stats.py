r"""Log-probs and entropies from one tensor-parallel rank's share of the vocabulary, forward and backward, in
pieces of several sizes: the transient memory and time of ``vime.backends.megatron.vocab_parallel_token_stats``.

One rank (a group of one) holds ``--share`` logits per position for ``--rows`` x ``--positions`` positions
(Qwen3's 151,936 tokens over 4 ranks: 37,984), bf16 on a GPU, fp32 on CPU. Per piece size, in a process
of its own: the median seconds of forward plus backward over ``--steps`` after a warm-up, and the peak
memory above what was held before the first step (the logits and the per-token inputs), so the
logits' gradient, one more tensor of their size and dtype, is part of it (on a GPU, torch's peak
allocation; on CPU, the process's peak resident size, reset after the set-up). ``--pieces 0`` is one
piece per row. The log-probs of every piece size are compared with the first as a check.

Usage::

    python bench/vocab_stats.py --rows 4 --positions 8192 --json bench/results/vocab-stats-h200.json
    python bench/vocab_stats.py --rows 1 --positions 2048 --share 37984 --steps 2   # CPU

It measures; it decides nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def measure(rows: int, positions: int, share: int, piece_elements: int, steps: int) -> dict[str, Any]:
    """One piece size, in this process: times, peak memory, and the log-probs' sum (the check)."""
    from vime.backends import megatron

    megatron.init_parallel(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, positions, share, generator=generator).mul_(3).to(device, dtype).requires_grad_()
    targets = torch.randint(0, share, (rows, positions), generator=generator).to(device)
    weights = torch.randn(rows, positions, generator=generator).to(device)
    pieces = piece_elements or positions * share
    times, checksum = [], 0.0
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from here
        before = _status_bytes("VmRSS")
    for step in range(steps + 1):
        logits.grad = None
        started = time.perf_counter()
        chosen, entropy = megatron.vocab_parallel_token_stats(logits, targets, 0.7, entropy_grad=True,
                                                              piece_elements=pieces)
        ((weights * chosen).sum() + entropy.sum()).backward()
        checksum = float(chosen.sum())  # waits for the device
        if step:
            times.append(time.perf_counter() - started)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status_bytes("VmHWM") - before
    return {"piece_elements": piece_elements, "seconds": statistics.median(times), "peak_bytes": peak,
            "logprob_sum": checksum}


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (Linux), in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--share", type=int, default=37984)
    parser.add_argument("--pieces", type=int, nargs="+", default=[0, 1 << 28, 1 << 26, 1 << 24],
                        help="piece sizes in elements (0: a row each)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: this piece size only
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.rows, args.positions, args.share, args.one, args.steps)))
        return
    results = []
    for pieces in args.pieces:
        child = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--positions", str(args.positions),
                                "--share", str(args.share), "--steps", str(args.steps), "--one", str(pieces)],
                               capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"piece size {pieces} failed (exit {child.returncode}):\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    first = results[0]
    print(f"{'piece elements':>15} {'seconds':>9} {'peak GB':>8} {'x time':>7} {'logprob sum gap':>16}")
    for row in results:
        print(f"{row['piece_elements'] or 'a row':>15} {row['seconds']:9.3f} {row['peak_bytes'] / 1e9:8.2f} "
              f"{row['seconds'] / first['seconds']:7.2f} {abs(row['logprob_sum'] - first['logprob_sum']):16.3g}")
    if args.json:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        args.json.write_text(json.dumps({"device": device, "rows": args.rows, "positions": args.positions,
                                         "share": args.share, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
