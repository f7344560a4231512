"""slime's own launchers on vime (issue 33's acceptance): the flag arrays of THUDM/slime's scripts/run-qwen3-4B.sh
(at commit 05a0752) and scripts/run-qwen3-30B-A3B.sh (at 128cb0e), typed in as they are (with their MODEL_ARGS from
scripts/models/ and their SGLang flags), planned by ``--dry-run --dry-run-gpus 8`` on a folder holding the real
model's config.json and the Qwen3 tokenizer (no weights).

Left out of each script: the lines that start Ray and clean up (``pkill``, ``ray stop``/``ray start``, the
``ray job submit --address ... --runtime-env-json ...`` wrapper around ``python3 train.py``) and the environment
they set (PYTHONBUFFERED, SGLANG_MEMORY_SAVER_CUDA_GRAPH, the NVLink probe for NCCL_NVLS_ENABLE): none reaches
train.py's parser. Paths under /root/ are the test's folder; ``${WANDB_KEY}`` is a stand-in value. vime adds one
thing slime has no flag for: ``--train-backend megatron --rollout-backend vllm`` (slime always trains with Megatron
and generates with SGLang; vime's scenarios default to its plain-PyTorch engines).

Both run the ``slime`` scenario: slime's and Megatron's defaults where the scripts' flags are silent (the prompt
row as it is, thinking on, the loss averaged per response, eval sampled as the rollout, no eval or checkpoint
unless asked), so the resolved config is what slime runs, not a task scenario's defaults (qwen3_4b_gsm8k's GSM8K
instruction and thinking off, with which --rm-type deepscaler scored every sample 0). Any flag refused is one of
the features vime lacks (issue 33, item 6), all named in one message. Each value asserted is one the flags moved
from that scenario's defaults, except those named where slime's own default is the value (the flag, if any,
restates it).
"""

from __future__ import annotations

import dataclasses
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
from vime.scenarios import slime

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
        pytest.skip(f"slime's launchers are planned on the real Qwen3 tokenizer, which the shared data folder holds "
                    f"and this machine lacks: no {TOKENIZER / 'tokenizer.json'} (set VIME_SHARED_DATA to a folder "
                    "holding qwen3-tokenizer/)")
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


BASE = dataclasses.asdict(slime.defaults())  # what the slime scenario runs without any flag

# Where slime's own default is what it runs, so no flag had to move it from the slime scenario's (which has
# slime's default there): (section, setting): (the value, why it is slime's default or the script flag restating it).
SLIMES_DEFAULT_TOO = {
    ("data", "input_key"): ("prompt", "--input-key prompt: slime's default and vime's"),
    ("data", "label_key"): ("label", "--label-key label: slime's default and vime's"),
    ("data", "prompt_template"): ("{prompt}", "slime sends the row as it is"),
    ("data", "enable_thinking"): (True, "slime passes no apply_chat_template_kwargs: Qwen3's template thinks"),
    ("sampling", "top_p"): (1.0, "slime's --rollout-top-p defaults to 1.0"),
    ("sampling", "top_k"): (0, "slime's --rollout-top-k defaults to off (-1; vime's 0)"),
    ("loss", "clip_low"): (0.2, "--eps-clip 0.2: slime's default"),
    ("loss", "kl_loss_coef"): (0.0, "--kl-loss-coef 0.00: slime's default"),
    ("loss", "entropy_coef"): (0.0, "--entropy-coef 0.00: slime's default"),
    ("loss", "loss_aggregation"): ("sequence", "no --calculate-per-token-loss: slime's per-response mean"),
    ("optim", "lr"): (1e-6, "slime's train.py resets Megatron's --lr to 1e-6; the scripts restate it"),
    ("optim", "lr_warmup_steps"): (0, "Megatron's --lr-warmup-iters defaults to 0"),
    ("ppo", "lam"): (1.0, "slime's --lambd defaults to 1.0"),
    ("job", "seed"): (1234, "slime's --seed defaults to 1234"),
    ("optim", "adam_beta1"): (0.9, "--adam-beta1 0.9: Megatron's default"),
    ("optim", "grad_clip"): (1.0, "Megatron's --clip-grad defaults to 1.0"),
    ("job", "algo"): ("grpo", "--advantage-estimator grpo: slime's default"),
    ("job", "expert_model_parallel_size"): (1, "--expert-model-parallel-size 1: Megatron's default"),
    ("eval", "eval_temperature"): (0.0, "slime's eval temperature defaults to the rollout's (vime's 0)"),
    ("eval", "eval_top_k"): (-1, "slime's eval top-k defaults to the rollout's (vime's -1)"),
    ("eval", "eval_every"): (0, "no --eval-interval: slime evaluates never"),
    ("job", "save_every"): (0, "no --save-interval: slime saves never"),
}


def assert_resolved(config: dict, expected: dict[tuple[str, str], object]) -> None:
    """Each ``(section, setting): value`` of ``expected`` is what vime resolved, and differs from the slime
    scenario's default (the flags moved it) unless it is slime's default too (:data:`SLIMES_DEFAULT_TOO`)."""
    for (section, name), value in expected.items():
        assert config[section][name] == value, (section, name, config[section][name])
        if BASE[section][name] == value:
            assert SLIMES_DEFAULT_TOO.get((section, name), (object(),))[0] == value, (
                f"{section}.{name} = {value!r} is the slime scenario's default already: no flag had to set it")


def test_the_slime_scenario_has_slimes_defaults():
    """What :data:`SLIMES_DEFAULT_TOO` counts on: the slime scenario runs slime's default there."""
    for (section, name), (value, why) in SLIMES_DEFAULT_TOO.items():
        assert BASE[section][name] == value, (section, name, why)


def assert_slimes_recipe(config: dict, *, prompts: int, samples: int, tensor: int, data: int, experts: int,
                         eval_every: int, save_every: int, max_tokens: int) -> None:
    """What both scripts ask for, as vime resolved it."""
    assert_resolved(config, {
        ("data", "rollout_batch_size"): prompts, ("data", "group_size"): samples,
        ("data", "chat_template"): True, ("data", "input_key"): "prompt", ("data", "label_key"): "label",
        ("data", "prompt_template"): "{prompt}", ("data", "enable_thinking"): True,
        ("optim", "updates_per_step"): 1,  # --global-batch-size = prompts x samples: one optimizer step
        ("sampling", "max_new_tokens"): 8192, ("sampling", "temperature"): 0.8,
        ("sampling", "top_p"): 1.0, ("sampling", "top_k"): 0,
        ("loss", "clip_low"): 0.2, ("loss", "clip_high"): 0.28, ("loss", "kl_loss_coef"): 0.0,
        ("loss", "kl_estimator"): "low_var_kl", ("loss", "entropy_coef"): 0.0, ("loss", "loss_aggregation"): "sequence",
        ("optim", "lr"): 1e-6, ("optim", "lr_schedule"): "constant", ("optim", "lr_warmup_steps"): 0,
        ("optim", "weight_decay"): 0.1, ("optim", "adam_beta1"): 0.9, ("optim", "adam_beta2"): 0.98,
        ("optim", "grad_clip"): 1.0,
        ("optim", "use_dynamic_batch_size"): True, ("optim", "max_tokens_per_gpu"): max_tokens,
        ("job", "algo"): "grpo", ("job", "steps"): 3000, ("job", "train_backend"): "megatron",
        ("job", "recompute_activations"): True, ("job", "tensor_model_parallel_size"): tensor,
        ("job", "data_parallel_size"): data, ("job", "expert_model_parallel_size"): experts,
        ("job", "save_every"): save_every,
        ("placement", "actor_num_gpus_per_node"): 8, ("placement", "colocate"): True,
        ("reward", "reward"): "deepscaler",
        ("eval", "eval_samples"): 16, ("eval", "eval_max_new_tokens"): 16384, ("eval", "eval_top_p"): 0.7,
        ("eval", "eval_temperature"): 0.0, ("eval", "eval_top_k"): -1,  # 0 and -1: the rollout's 0.8 and top-k
        ("eval", "eval_every"): eval_every,
    })
    assert config["eval"]["eval_data"].endswith("aime-2024/aime-2024.jsonl")
    assert config["rollout"]["vllm_args"]["gpu_memory_utilization"] == 0.7


def test_run_qwen3_4b_sh(root):
    """Accepted as it is: slime's recipe in slime's layout, TP 2 over 8 GPUs (data parallel 4, derived), 4 engines
    of 2 GPUs colocated, micro-batches of at most 9216 tokens per data-parallel rank, --save/--load the run
    folder."""
    result = dry_run("slime", RUN_QWEN3_4B, root)
    config = resolved(result)
    assert_slimes_recipe(config, prompts=32, samples=8, tensor=2, data=4, experts=1, eval_every=20, save_every=20,
                         max_tokens=9216)
    assert (config["rollout"]["rollout_num_gpus_per_engine"], config["rollout"]["rollout_workers"]) == (2, 4)
    assert (config["loss"]["off_policy_correction"], config["model"]["model_path"]) == ("none", f"{root}/Qwen3-4B")
    assert f"the run would write {root}/Qwen3-4B_slime" in result.stdout  # --save
    assert "note: --ref-load" in result.stderr


def test_run_qwen3_30b_a3b_sh(root):
    """Refused for optimizer offload, the precision-aware optimizer and W&B, in one message; without them slime's
    MoE layout (TP 4, EP 8, data parallel 2 derived), one engine of 8 GPUs, TIS at the
    sequence's geometric mean."""
    result = dry_run("slime", RUN_QWEN3_30B_A3B, root)
    assert result.returncode == 2
    refused = refused_flags(result.stderr)
    assert refused == {"--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer",
                       "--use-wandb"}
    result = dry_run("slime", without(RUN_QWEN3_30B_A3B, refused), root)
    config = resolved(result)
    # the W&B settings, which slime reads only with --use-wandb, are accepted with a note, the key not shown
    assert "note: --wandb-project, --wandb-group, --wandb-run-id, --wandb-key ignored" in result.stderr
    assert "WANDB_KEY" not in result.stderr + result.stdout
    assert_slimes_recipe(config, prompts=8, samples=4, tensor=4, data=2, experts=8, eval_every=0, save_every=0,
                         max_tokens=20480)
    loss = config["loss"]
    assert (loss["off_policy_correction"], loss["tis_level"], loss["tis_cap"], loss["tis_floor"]) == (
        "tis", "sequence-geometric", 2.0, 0.0)
    assert (config["rollout"]["rollout_num_gpus_per_engine"], config["rollout"]["rollout_workers"]) == (8, 1)
    assert config["rollout"]["vllm_args"]["cudagraph_capture_sizes"] == [1, 2, 4, 8, *range(16, 257, 8)]
