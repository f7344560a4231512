"""CPU sampling over a real-size vocabulary: the reference rollout engine's sampler against torch's.

One decode step of the CPU engine samples one token per running sequence
from a ``[rows, vocab]`` distribution. This measures, side by side in one
run, the two parts that dominate on a CPU with Qwen3's 151,680-token
vocabulary:

* drawing the token: ``torch.multinomial(softmax(logprobs))`` (what the
  engine used before) against ``torch_rollout._sample_tokens`` (inverse CDF
  in float64 at one uniform draw per row);
* top-k filtering: a full ``torch.sort`` of the vocabulary (before) against
  ``torch_rollout._top_k_top_p``, which ranks only the best k when every
  row has a top-k.

Medians over ``--repeats`` timed calls, after one warm-up; ratios are
old / new. Usage::

    python bench/sampling.py --json bench/results/sampling-cpu.json
    python bench/sampling.py --rows 16 64 --vocab 151680 --threads 1

It measures; it decides nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from vime.backends.torch_rollout import _sample_tokens, _top_k_top_p


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _sorted_top_k(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    """The previous filter: sort the whole vocabulary, keep the first k of each row."""
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    sorted_lp[:, k:] = float("-inf")
    return torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)


def measure(rows: int, vocab: int, repeats: int) -> list[dict[str, object]]:
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(rows, vocab, generator=generator), dim=-1)
    pairs = {
        "draw a token": (lambda: torch.multinomial(torch.softmax(logprobs, -1), 1, generator=generator),
                         lambda: _sample_tokens(logprobs, torch.rand((rows, 1), generator=generator,
                                                                     dtype=torch.float64))),
        "top-k 1 filter": (lambda: _sorted_top_k(logprobs, 1),
                           lambda: _top_k_top_p(logprobs, [1] * rows, [1.0] * rows)),
    }
    results = []
    for part, (old, new) in pairs.items():
        old_s, new_s = _median_s(old, repeats), _median_s(new, repeats)
        results.append({"part": part, "rows": rows, "vocab": vocab, "old_ms": round(old_s * 1e3, 2),
                        "new_ms": round(new_s * 1e3, 2), "old_over_new": round(old_s / new_s, 2)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--vocab", type=int, default=151_680)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [row for rows in args.rows for row in measure(rows, args.vocab, args.repeats)]
    print(f"{'part':<16} {'rows':>5} {'old ms':>8} {'new ms':>8} {'old/new':>8}")
    for row in results:
        print(f"{row['part']:<16} {row['rows']:>5} {row['old_ms']:>8} {row['new_ms']:>8} {row['old_over_new']:>8}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "threads": args.threads,
                                         "machine": platform.machine(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
