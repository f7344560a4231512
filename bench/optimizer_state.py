"""Optimizer-state bytes per rank of the Megatron trainer with and without ``--use-distributed-optimizer``, on CPU.

Data parallelism over one GPU is degenerate, so the figure issue 34 asks for is measured here: for each
``--data-parallel`` size it starts that many gloo ranks under torchrun, each building the trainer twice (plain
AdamW, then the distributed optimizer) on a random Qwen3 of ``--hidden-size`` x ``--layers``, takes one step
(Adam's state is made on the first) and reports every rank's bytes of Adam's state (moments and step counts)
and of the fp32 masters (``--dtype bf16``; in fp32 the parameters are the masters), each plain and distributed
(the largest rank's). Prints a markdown table::

    python bench/optimizer_state.py --data-parallel 2 4 --hidden-size 256 --layers 4 --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def measure_on_this_rank(folder: str, data_parallel: int, dtype: str) -> None:
    """One rank of the torchrun launch: rank 0 prints one JSON line of every rank's bytes."""
    import torch.distributed as dist

    from vime.algorithms.grpo import GRPOConfig
    from vime.algorithms.policy_loss import PolicyLossConfig
    from vime.algorithms.ppo import PPOConfig
    from vime.backends.base import collate
    from vime.backends.megatron import MegatronTrainEngine
    from vime.backends.megatron.distributed_optimizer import master_bytes, state_bytes
    from vime.backends.plain_collectives import gather_plain
    from vime.config import OptimConfig

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (6,), generator=generator).tolist() for _ in range(8)]
    responses = [torch.randint(1, 256, (5,), generator=generator).tolist() for _ in range(8)]
    batch = collate(prompts, responses, [[-5.0] * 5] * 8, [[0] * 5] * 8, rewards=[1.0, 0.0] * 4,
                    group_ids=[0] * 4 + [1] * 4, pad_token_id=0)
    figures = {}
    for name, distributed in (("plain", False), ("distributed", True)):
        engine = MegatronTrainEngine(folder, algo="grpo", optim=OptimConfig(updates_per_step=1, micro_batch_size=4),
                                     loss=PolicyLossConfig(), grpo_config=GRPOConfig(), ppo_config=PPOConfig(),
                                     temperature=1.0, dtype=dtype, data_parallel=data_parallel,
                                     distributed_optimizer=distributed)
        engine.train_step(batch)
        mine = [state_bytes(engine.optimizer), master_bytes(engine.masters)]
        figures[name] = gather_plain(mine)
        del engine
    if dist.get_rank() == 0:
        print(json.dumps(figures), flush=True)
    dist.destroy_process_group()


def write_model(folder: Path, hidden_size: int, layers: int) -> int:
    """A random Qwen3 of that shape (vocabulary 256) saved as a Hugging Face folder; its parameter count."""
    import transformers

    from vime.devtools.make_tiny_model import tiny_config

    config = tiny_config("qwen3", 256, hidden_size=hidden_size, layers=layers)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return sum(param.numel() for param in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-parallel", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        parameters = write_model(Path(folder), args.hidden_size, args.layers)
        print(f"Qwen3 {args.hidden_size} x {args.layers} layers, {parameters:,} parameters, {args.dtype}\n")
        print("| DP | Adam state per rank, plain | distributed | ratio | fp32 masters per rank, plain | distributed "
              "| ratio |")
        print("|---|---|---|---|---|---|---|")
        for data_parallel in args.data_parallel:
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   str(data_parallel), __file__, "--rank-of", folder, str(data_parallel), args.dtype],
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(done.stderr[-3000:])
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            columns = [_largest_and_ratio([rank[kind] for rank in figures["plain"]],
                                          [rank[kind] for rank in figures["distributed"]]) for kind in (0, 1)]
            print(f"| {data_parallel} | {' | '.join(columns)} |")


def _largest_and_ratio(plain: list[int], distributed: list[int]) -> str:
    """Table cells of one kind of bytes: the largest rank's plain and distributed, and their ratio."""
    largest, divided = max(plain), max(distributed)
    ratio = f"{divided / largest:.3f}" if largest else "-"
    return f"{largest:,} B | {divided:,} B | {ratio}"


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ and sys.argv[1] == "--rank-of":
        measure_on_this_rank(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
