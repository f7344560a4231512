"""slime's own launchers on vime (issue 33's acceptance): the flag arrays of THUDM/slime's scripts/run-qwen3-4B.sh and
scripts/run-qwen3-30B-A3B.sh, typed in as they are (with their MODEL_ARGS from scripts/models/ and their SGLang
flags), planned by ``--dry-run --dry-run-gpus 8`` on a folder holding the real model's config.json and the Qwen3
tokenizer (no weights).

Left out of each script: the lines that start Ray and clean up (``pkill``, ``ray stop``/``ray start``, the
``ray job submit --address ... --runtime-env-json ...`` wrapper around ``python3 train.py``) and the environment
they set (PYTHONBUFFERED, SGLANG_MEMORY_SAVER_CUDA_GRAPH, the NVLink probe for NCCL_NVLS_ENABLE): none reaches
train.py's parser. Paths under /root/ are the test's folder; ``${WANDB_KEY}`` is a stand-in value. vime adds one
thing slime has no flag for: ``--train-backend megatron --rollout-backend vllm`` (slime always trains with Megatron
and generates with SGLang; vime's scenarios default to its plain-PyTorch engines).

Any flag refused is one of the features vime lacks (issue 33, item 6), all named in one message; without them the
resolved config is what slime runs, in what the scripts' flags say. What they leave to the scenario is the
scenario's (qwen3_4b_gsm8k: GSM8K's instruction after the prompt, the loss averaged over tokens, thinking off,
greedy eval; qwen3_30b_a3b_dapo: DAPO's instruction around the prompt, routing replay on, an eval and a checkpoint
every 20 steps), not slime's defaults: slime's DAPO rows hold their instruction already, so a launcher of them
passes --prompt-template '{prompt}' (and --loss-aggregation sequence for slime's per-response mean).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_megatron_flags import (
    MISC_ARGS,
    QWEN3_4B_CONFIG,
    QWEN3_4B_MODEL_ARGS,
    QWEN3_30B_A3B_CONFIG,
    QWEN3_30B_A3B_MODEL_ARGS,
)

from vime.devtools.shared_data import shared_data

TOKENIZER = shared_data() / "qwen3-tokenizer"

# run-qwen3-4B.sh after `source scripts/models/qwen3-4B.sh`, in the order train.py gets them
RUN_QWEN3_4B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    *QWEN3_4B_MODEL_ARGS,
    # CKPT_ARGS
    "--hf-checkpoint", "/root/Qwen3-4B", "--ref-load", "/root/Qwen3-4B_torch_dist", "--load", "/root/Qwen3-4B_slime/",
    "--save", "/root/Qwen3-4B_slime/", "--save-interval", "20",
    # ROLLOUT_ARGS
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000",
    "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
    "--rollout-temperature", "0.8", "--global-batch-size", "256", "--balance-data",
    # OPTIMIZER_ARGS
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    # GRPO_ARGS
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    # PERF_ARGS
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    # EVAL_ARGS
    "--eval-interval", "20", "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "16", "--eval-max-response-len", "16384", "--eval-top-p", "0.7",
    # SGLANG_ARGS
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
    *MISC_ARGS,
]
# run-qwen3-30B-A3B.sh after `source scripts/models/qwen3-30B-A3B.sh`
RUN_QWEN3_30B_A3B = [
    "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8", "--colocate",
    *QWEN3_30B_A3B_MODEL_ARGS,
    "--hf-checkpoint", "/root/Qwen3-30B-A3B", "--ref-load", "/root/Qwen3-30B-A3B_torch_dist",
    "--prompt-data", "/root/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3000",
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8192",
    "--rollout-temperature", "0.8", "--global-batch-size", "32", "--balance-data",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--use-tis", "--tis-level", "geometric",
    "--use-wandb", "--wandb-project", "slime-dev", "--wandb-group", "qwen3-30B-A3B-TIS", "--wandb-run-id",
    "qwen3-30B-A3B-TIS-sequence", "--wandb-key", "WANDB_KEY",
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20480",
    "--eval-prompt-data", "aime", "/root/aime-2024/aime-2024.jsonl", "--n-samples-per-eval-prompt", "16",
    "--eval-max-response-len", "16384", "--eval-top-p", "0.7",
    "--rollout-num-gpus-per-engine", "8", "--sglang-mem-fraction-static", "0.7",
    "--sglang-cuda-graph-bs", "1", "2", "4", "8", *map(str, range(16, 257, 8)),  # $(seq 16 8 256)
    *MISC_ARGS,
]
VIME_BACKENDS = ["--train-backend", "megatron", "--rollout-backend", "vllm"]


@pytest.fixture
def root(tmp_path) -> Path:
    """What the scripts' /root/ holds, as far as a dry run reads it: the two models' config.json and tokenizer (no
    weights) and one row each of the prompt and eval files in slime's shape."""
    if not (TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"the shared Qwen3 tokenizer is not at {TOKENIZER} (set VIME_SHARED_DATA to the shared data)")
    for name, config in (("Qwen3-4B", QWEN3_4B_CONFIG), ("Qwen3-30B-A3B", QWEN3_30B_A3B_CONFIG)):
        shutil.copytree(TOKENIZER, tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    for rows in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl"):
        (tmp_path / rows).parent.mkdir()
        (tmp_path / rows).write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n")
    return tmp_path


def dry_run(scenario: str, flags: list[str], root: Path) -> subprocess.CompletedProcess:
    at_root = [flag.replace("/root/", f"{root}/") for flag in flags]
    return subprocess.run([sys.executable, "-m", "vime.scenario", scenario, "--dry-run", "--dry-run-gpus", "8",
                           *VIME_BACKENDS, *at_root], capture_output=True, text=True, timeout=300)


def refused_flags(stderr: str) -> set[str]:
    """The flags item 6's one message names (``vime does not have what these flags ask for yet: A, B N (what);
    ...``), as given; asserts that it is that message."""
    assert "vime does not have what these flags ask for yet: " in stderr, stderr
    listed = stderr.split("ask for yet: ", 1)[1].split(". Leave them out", 1)[0]
    groups = re.findall(r"(?:^|; )(--[\w-]+(?: \d+)?(?:, --[\w-]+(?: \d+)?)*) \(", listed)
    return {flag for group in groups for flag in group.split(", ")}


def without(flags: list[str], refused: set[str]) -> list[str]:
    """``flags`` with the refused ones taken out, each with its values (the tokens up to the next flag)."""
    names = {spelled.split()[0] for spelled in refused}
    kept, dropping = [], False
    for token in flags:
        if token.startswith("--"):
            dropping = token in names
        if not dropping:
            kept.append(token)
    return kept


def resolved(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout[:result.stdout.index("\nplacement on")])


def assert_slimes_recipe(config: dict, *, prompts: int, samples: int, tensor: int, data: int, experts: int) -> None:
    """What both scripts ask for, as vime resolved it."""
    assert (config["data"]["rollout_batch_size"], config["data"]["group_size"]) == (prompts, samples)
    assert config["optim"]["updates_per_step"] == 1  # --global-batch-size = prompts x samples: one optimizer step
    assert (config["sampling"]["max_new_tokens"], config["sampling"]["temperature"]) == (8192, 0.8)
    assert (config["sampling"]["top_p"], config["sampling"]["top_k"]) == (1.0, 0)  # slime's defaults: both off
    loss = config["loss"]
    assert (loss["clip_low"], loss["clip_high"], loss["kl_loss_coef"], loss["kl_estimator"], loss["entropy_coef"]) \
        == (0.2, 0.28, 0.0, "low_var_kl", 0.0)
    optim = config["optim"]
    assert (optim["lr"], optim["lr_schedule"], optim["lr_warmup_steps"], optim["weight_decay"], optim["adam_beta1"],
            optim["adam_beta2"], optim["grad_clip"]) == (1e-6, "constant", 0, 0.1, 0.9, 0.98, 1.0)
    job = config["job"]
    assert (job["algo"], job["steps"], job["train_backend"], job["recompute_activations"]) == (
        "grpo", 3000, "megatron", True)
    assert (job["tensor_model_parallel_size"], job["data_parallel_size"], job["expert_model_parallel_size"]) == (
        tensor, data, experts)
    assert (config["placement"]["actor_num_gpus_per_node"], config["placement"]["colocate"]) == (8, True)
    assert (config["reward"]["reward"], config["data"]["chat_template"]) == ("deepscaler", True)
    assert (config["data"]["input_key"], config["data"]["label_key"]) == ("prompt", "label")
    evaluation = config["eval"]
    assert (evaluation["eval_samples"], evaluation["eval_max_new_tokens"], evaluation["eval_top_p"]) == (16, 16384, 0.7)
    assert evaluation["eval_data"].endswith("aime-2024/aime-2024.jsonl")
    assert config["rollout"]["vllm_args"]["gpu_memory_utilization"] == 0.7


def test_run_qwen3_4b_sh(root):
    """Refused for its token-budget micro-batches only; without them, slime's recipe in slime's layout: TP 2 over 8
    GPUs (data parallel 4, derived), 4 engines of 2 GPUs colocated, --save/--load the run folder."""
    result = dry_run("qwen3_4b_gsm8k", RUN_QWEN3_4B, root)
    assert result.returncode == 2
    refused = refused_flags(result.stderr)
    assert refused == {"--use-dynamic-batch-size", "--max-tokens-per-gpu 9216"}
    result = dry_run("qwen3_4b_gsm8k", without(RUN_QWEN3_4B, refused), root)
    config = resolved(result)
    assert_slimes_recipe(config, prompts=32, samples=8, tensor=2, data=4, experts=1)
    assert (config["job"]["save_every"], config["eval"]["eval_every"]) == (20, 20)
    assert (config["rollout"]["rollout_num_gpus_per_engine"], config["rollout"]["rollout_workers"]) == (2, 4)
    assert (config["loss"]["off_policy_correction"], config["model"]["model_path"]) == ("none", f"{root}/Qwen3-4B")
    assert f"the run would write {root}/Qwen3-4B_slime" in result.stdout  # --save
    assert "note: --ref-load" in result.stderr


def test_run_qwen3_30b_a3b_sh(root):
    """Refused for token-budget micro-batches, optimizer offload, the precision-aware optimizer and W&B, in one
    message; without them slime's MoE layout (TP 4, EP 8, data parallel 2 derived), one engine of 8 GPUs, TIS at the
    sequence's geometric mean."""
    result = dry_run("qwen3_30b_a3b_dapo", RUN_QWEN3_30B_A3B, root)
    assert result.returncode == 2
    refused = refused_flags(result.stderr)
    assert refused == {"--use-dynamic-batch-size", "--max-tokens-per-gpu 20480", "--optimizer-cpu-offload",
                       "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", "--use-wandb",
                       "--wandb-project", "--wandb-group", "--wandb-run-id", "--wandb-key"}
    config = resolved(dry_run("qwen3_30b_a3b_dapo", without(RUN_QWEN3_30B_A3B, refused), root))
    assert_slimes_recipe(config, prompts=8, samples=4, tensor=4, data=2, experts=8)
    loss = config["loss"]
    assert (loss["off_policy_correction"], loss["tis_level"], loss["tis_cap"], loss["tis_floor"]) == (
        "tis", "sequence-geometric", 2.0, 0.0)
    assert (config["rollout"]["rollout_num_gpus_per_engine"], config["rollout"]["rollout_workers"]) == (8, 1)
    assert config["rollout"]["vllm_args"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, *range(16, 257, 8)]
