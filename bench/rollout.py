"""vime's vLLM rollout engine against bare vLLM, and its weight paths against bare transfers, in one run.

Each model shape runs in subprocesses of its own (a vLLM engine does not give all of its memory back):

* generation: the same prompts, lengths and sampling through bare vLLM (``LLM.generate``, vLLM's
  defaults) and through ``VllmRolloutEngine`` stepped the way the rollout worker steps it
  (per-token log-probs and versions kept) -- output tokens/s and the ratio. Both run vLLM's
  asynchronous scheduling;
* weight updates of a full set (bf16, on the GPU), each against the bare floor for the same bytes
  in the same run (medians of ``--rounds``):

  - by reference, in-process (``load_weights``) against a ``copy_`` into vLLM's parameters;
  - CUDA IPC from another process on the same GPU (``load_shared``) against opening the same
    handles and copying into preallocated tensors;
  - NCCL broadcast in buckets from a process on a second GPU (``receive_broadcast``) against one
    broadcast of the same bytes over the same group (needs two GPUs: device kind nvidia-h200-x2);

* ``train_rollout_logprob_abs_diff`` is measured by ``bench/alignment.py``, against each trainer.

Dummy random weights, Qwen3 shapes; random weights never emit EOS, so every response runs to its
length. Prints a table, writes JSON::

    python bench/rollout.py --models 0.6b,4b --json rollout.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM = dict(gpu_memory_utilization=0.45, max_model_len=2048, attention_backend="FLASH_ATTN")


def _config(shape: str):
    """The published Qwen3 config of ``shape`` (0.6b, 4b), as ``make_tiny_model --shape`` writes it."""
    from vime.devtools.make_tiny_model import full_config

    config = full_config(f"qwen3-{shape}", bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def _config_folder(shape: str) -> str:
    folder = tempfile.mkdtemp(prefix=f"qwen3-{shape}-")
    _config(shape).save_pretrained(folder)
    return folder


def _prompts(count: int, length: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 151643, (count, length), generator=generator).tolist()


def bare(shape: str, args: argparse.Namespace) -> dict:
    """Bare vLLM: LLM.generate on token prompts, as a user of vLLM alone would call it."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=_config_folder(shape), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_num_seqs=args.prompts, seed=0, **(VLLM | args.vllm_args))
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
                               engine_args=dict(load_format="dummy", **(VLLM | args.vllm_args)))
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new)
    prompts = _prompts(args.prompts, args.prompt_len)

    def generate(count: int) -> tuple[float, int]:
        sequences = [Sequence(index, prompt, params, stream=args.stream)
                     for index, prompt in enumerate(prompts[:count])]
        engine.add(sequences)
        start = time.perf_counter()
        while engine.busy:
            engine.step()
        return time.perf_counter() - start, sum(len(s.response_ids) for s in sequences)

    generate(16)  # warm-up
    seconds, tokens = generate(args.prompts)
    result = {"vime_gen_s": seconds, "vime_tokens_per_s": tokens / seconds}
    model = engine.engine.collective_rpc(lambda worker: worker.model_runner.model)[0]  # in-process
    weights = _random_weights(shape)
    result["weights_gb"] = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    versions = iter(range(1, 1000))
    result["vime_load_s"] = _median_time(lambda: engine.load_weights(weights, next(versions)), args.rounds)
    weights.clear()
    targets = list(model.parameters())
    sources = [torch.empty_like(p) for p in targets]
    result["bare_copy_s"] = _median_time(lambda: [t.data.copy_(s) for t, s in zip(targets, sources)], args.rounds)
    sources.clear()
    if shape in args.update_models.split(","):
        result |= _ipc_update(engine, shape, args, versions)
        if torch.cuda.device_count() > 1:
            result |= _nccl_update(engine, shape, args, versions)
    return result


def _median_time(work, rounds: int) -> float:
    """Median wall time of ``work`` over ``rounds``, GPU work included, after one round not counted."""
    import statistics

    import torch

    times = []
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _producer(shape: str, mode: str, args: argparse.Namespace) -> dict:
    """The trainer's side of a weight update, in a process of its own: share the weights over CUDA
    IPC (same GPU; descriptors to ``--address``, a file) and wait for stdin to close, or broadcast
    them (last GPU; group at ``--address``) for the vime rounds, then the bare rounds."""
    import msgpack
    import torch

    from vime.transports.gpu import BroadcastGroup, packed, share

    if mode == "ipc":
        weights = _random_weights(shape)
        buffers = [(flat.clone(), bucket) for flat, bucket in packed(weights.items(), args.bucket_mb << 20)]
        staged = Path(args.address + ".part")
        staged.write_bytes(msgpack.packb([(bucket, share(flat)) for flat, bucket in buffers]))
        staged.rename(args.address)  # appears whole
        sys.stdin.read()
        return {}
    torch.cuda.set_device(torch.cuda.device_count() - 1)
    weights = _random_weights(shape)
    group = BroadcastGroup(args.address, 0, 2)
    for _ in range(args.rounds + 1):
        group.send(weights, args.bucket_mb << 20)
    flat = torch.empty(sum(t.numel() for t in weights.values()), dtype=torch.bfloat16, device="cuda")
    for _ in range(args.rounds + 1):
        group.broadcast(flat)
    torch.cuda.synchronize()
    return {}


def _start_producer(shape: str, mode: str, address: str, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, __file__, "--one", f"producer-{mode}", shape, "--address", address,
               "--rounds", str(args.rounds), "--bucket-mb", str(args.bucket_mb)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=ROOT, text=True)


def _ipc_update(engine, shape: str, args: argparse.Namespace, versions) -> dict:
    """Weights from another process on this GPU, in buckets of ``--bucket-mb``: vime's ``load_shared`` against
    open + copy."""
    import msgpack
    import torch

    from vime.transports.gpu import open_shared, unpack

    path = Path(tempfile.mkdtemp(prefix="vime-ipc-"), "descriptors")
    producer = _start_producer(shape, "ipc", str(path), args)
    while not path.exists():
        time.sleep(0.1)
    shared = msgpack.unpackb(path.read_bytes())

    def update() -> None:
        version = next(versions)
        for index, (bucket, descriptor) in enumerate(shared):
            engine.load_shared(bucket, [descriptor], version, index, index == len(shared) - 1)

    result = {"ipc_update_s": _median_time(update, args.rounds)}
    targets = [[torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _, shape, _ in bucket]
               for bucket, _ in shared]

    def bare() -> None:
        for into, (bucket, descriptor) in zip(targets, shared):
            for target, (_, source) in zip(into, unpack(open_shared([descriptor]), bucket)):
                target.copy_(source)

    result["bare_ipc_s"] = _median_time(bare, args.rounds)
    producer.stdin.close()
    producer.wait()
    return result


def _nccl_update(engine, shape: str, args: argparse.Namespace, versions) -> dict:
    """Weights broadcast from a process on another GPU: vime's bucketed ``receive_broadcast`` against
    one broadcast of the same bytes over the same group."""
    import socket

    import torch

    from vime.transports.gpu import specs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    producer = _start_producer(shape, "nccl", address, args)
    spec_list = specs(dict(_hf_named_shapes(shape)))
    engine.join_broadcast(address, 1, 2)
    bucket = args.bucket_mb << 20
    result = {"nccl_update_s": _median_time(lambda: engine.receive_broadcast(spec_list, bucket, next(versions)),
                                            args.rounds), "bucket_mb": args.bucket_mb}
    group = engine.engine.collective_rpc(lambda worker: worker.vime_group)[0]  # in-process
    flat = torch.empty(sum(math.prod(shape) for _, shape, _ in spec_list), dtype=torch.bfloat16, device="cuda")
    result["bare_broadcast_s"] = _median_time(lambda: group.broadcast(flat), args.rounds)
    producer.wait()
    return result


def _random_weights(shape: str) -> dict:
    return {name: t.normal_(0, 0.02) for name, t in _hf_named_shapes(shape)}


def _hf_named_shapes(shape: str):
    """The checkpoint's (name, empty bf16 CUDA tensor) pairs, from a meta-device transformers model."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(_config(shape))
    return [(name, torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")) for name, p in model.named_parameters()]


PARTS = {"bare": bare, "vime": vime,
         "producer-ipc": lambda shape, args: _producer(shape, "ipc", args),
         "producer-nccl": lambda shape, args: _producer(shape, "nccl", args)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="0.6b,4b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--update-models", default="4b", help="shapes whose CUDA IPC and NCCL updates are measured")
    parser.add_argument("--rounds", type=int, default=5, help="timed weight updates per path (median quoted)")
    parser.add_argument("--bucket-mb", type=int, default=1024, help="bucket size of the CUDA IPC and NCCL updates")
    parser.add_argument("--vllm-args", type=json.loads, default={}, metavar="JSON",
                        help='more engine arguments for both engines, e.g. \'{"enable_sleep_mode": true}\'')
    parser.add_argument("--stream", action="store_true",
                        help="vime's engine hands each sequence its tokens every step (as to a streamed reply), "
                             "not once at its end")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--one", nargs=2, metavar=("PART", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.one:
        part, shape = args.one
        print("RESULT " + json.dumps(PARTS[part](shape, args)), flush=True)
        return 0
    rows = []
    for shape in args.models.split(","):
        row = {"shape": shape, "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new,
               "quantization": args.vllm_args.get("quantization")}  # None: the model's dtype
        for part in ("bare", "vime"):
            command = [sys.executable, __file__, "--one", part, shape, *sys.argv[1:]]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            found = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if found:
                row.update(json.loads(found[-1]))
            else:
                row[f"{part}_error"] = (done.stdout + done.stderr)[-3000:]
        if "vime_tokens_per_s" in row and "bare_tokens_per_s" in row:
            row["ratio"] = row["vime_tokens_per_s"] / row["bare_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ["shape", "quantization", "bare_tokens_per_s", "vime_tokens_per_s", "ratio", "weights_gb", "vime_load_s",
            "bare_copy_s", "ipc_update_s", "bare_ipc_s", "nccl_update_s", "bare_broadcast_s"]
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
