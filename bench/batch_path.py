"""A training batch's way from the buffer into the trainer's tensors, on the host: the buffer's encode of the
TrainBatch, the trainer's decode of its frame, and ``collate`` (the samples padded into one TensorBatch), in
milliseconds, at TRL's GRPO sizes by default (512 samples, prompts of 60-194 tokens, 512-token responses).

Issue 36 asks where the host time of a step goes; these three run on every step, on the trainer's critical path
in a synchronous run. Random token ids and log-probs; no socket (the encode and decode are the codec's, as the
actors call it; the wire itself is ``bench/transport.py``'s). Each part is timed ``--rounds`` times and the
median quoted.

Usage::

    python bench/batch_path.py --json bench/results/batch-path-cpu.json
    PYTHONPATH=<another commit's tree>:<site-packages> python -S bench/batch_path.py   # older code; -S: no
                                                    # editable install's finder, which would win over PYTHONPATH

It measures; it decides nothing (the exit status does not depend on the figures).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from vime.backends.base import collate_samples
from vime.messages.pipeline import Sample, TrainBatch
from vime.transports.codec import Envelope, decode_frame, encode, encode_frame


def train_batch(samples: int, prompt_len: tuple[int, int], response_len: int, seed: int = 0) -> TrainBatch:
    """A batch of random samples as the buffer sends it (groups of 8, a response text of ~3 characters a token)."""
    rng = random.Random(seed)
    return TrainBatch(step=1, stats={"time_generate_s": 1.0}, samples=[
        Sample(group_id=i // 8, index=i % 8,
               prompt_ids=[rng.randrange(150_000) for _ in range(rng.randint(*prompt_len))],
               response_ids=[rng.randrange(150_000) for _ in range(response_len)],
               logprobs=[-rng.random() for _ in range(response_len)], versions=[0] * response_len,
               finish_reason="length", label="7", metadata={}, response_text="x" * (3 * response_len), reward=1.0)
        for i in range(samples)])


def timed(part: Callable[[], Any], rounds: int) -> tuple[float, Any]:
    """Median milliseconds of ``rounds`` calls, and the last call's result."""
    times, result = [], None
    for _ in range(rounds):
        started = time.perf_counter()
        result = part()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


def measure(batch: TrainBatch, rounds: int) -> dict[str, float]:
    """Milliseconds of each part, and the frame's size."""
    envelope = Envelope("TrainBatch", "buffer", "trainer", 1, None, 0.0, None, False, batch)
    encode_ms, frame = timed(lambda: encode_frame("ipc:///buffer", None, [encode(envelope)]), rounds)
    decode_ms, decoded = timed(lambda: decode_frame(frame, max_message_bytes=1 << 34), rounds)
    samples = decoded.messages[0].payload.samples
    collate_ms, _ = timed(lambda: collate_samples(samples, 0), rounds)
    return dict(encode_ms=round(encode_ms, 1), decode_ms=round(decode_ms, 1), collate_ms=round(collate_ms, 1),
                frame_mb=round(len(frame) / 2**20, 2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--prompt-len", default="60:194", help="MIN:MAX tokens, uniform")
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    low, _, high = args.prompt_len.partition(":")
    row = measure(train_batch(args.samples, (int(low), int(high or low)), args.response_len), args.rounds)
    print(f"{'samples':>7} {'encode ms':>9} {'decode ms':>9} {'collate ms':>10} {'frame MiB':>9}")
    print(f"{args.samples:>7} {row['encode_ms']:>9} {row['decode_ms']:>9} {row['collate_ms']:>10} {row['frame_mb']:>9}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        document = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                        machine=f"{platform.machine()}, {platform.processor() or 'cpu'}, "
                                f"Python {platform.python_version()}",
                        command="python bench/batch_path.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                        vars(args).items() if k != "json"),
                        samples=args.samples, prompt_len=args.prompt_len, response_len=args.response_len, **row)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
