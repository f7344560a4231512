"""A slime user's flags on vime's command line (issue 33): no abbreviations, slime's names as aliases of the
settings that mean the same, and Megatron's derived data-parallel size."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import scenario_mains
from vime.config import RunConfig, add_flags, engine_flags, from_flags
from vime.settings import flags_of

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout)


def test_every_parser_refuses_abbreviations():
    """argparse's prefix matching would read --save-ev as vime's --save-every (slime's --save was ambiguous): every
    parser of vime's entry points is built with allow_abbrev=False, so a flag is taken whole or not at all."""
    parsers = []
    for path in [*(ROOT / "vime").rglob("*.py"), *(ROOT / "scenarios").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                parsers.append(path.relative_to(ROOT))
                keywords = {keyword.arg: keyword.value for keyword in node.keywords}
                assert "allow_abbrev" in keywords and keywords["allow_abbrev"].value is False, (
                    f"{path.relative_to(ROOT)}:{node.lineno}: pass allow_abbrev=False to ArgumentParser")
    assert len(parsers) >= 5  # scenario, actor, replay, inject, make_tiny_model


def test_an_abbreviated_flag_is_refused_by_name():
    for flag in ("--save-ev", "--rollout-batch", "--save-hf"):  # slime's --save is a flag of its own now
        result = run("vime.scenario", "arithmetic", flag, "3")
        assert result.returncode == 2 and f"unrecognized arguments: {flag} 3" in result.stderr, result.stderr
    result = run("vime.actor", "trainer", "--log-lev", "debug")
    assert result.returncode == 2 and "unrecognized arguments: --log-lev debug" in result.stderr, result.stderr


def parse(*flags: str, defaults: RunConfig | None = None) -> RunConfig:
    """The config a scenario with ``defaults`` runs with these flags, as vime.scenario resolves it."""
    defaults = RunConfig() if defaults is None else defaults
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_flags(parser, defaults)
    return from_flags(parser.parse_args(list(flags)), defaults)


# slime's spelling, vime's, and a value: each pair must set the same setting to the same value
SAME_MEANING = [
    ("--hf-checkpoint", "--model-path", "/models/Qwen3-4B"),
    ("--prompt-data", "--data", "/data/dapo-math-17k.jsonl"),
    ("--n-samples-per-prompt", "--group-size", "16"),
    ("--num-rollout", "--steps", "3000"),
    ("--rollout-max-response-len", "--max-new-tokens", "8192"),
    ("--rollout-temperature", "--temperature", "0.8"),
    ("--rollout-top-p", "--top-p", "0.95"),
    ("--rollout-top-k", "--top-k", "20"),
    ("--eps-clip-high", "--clip-high", "0.28"),
    ("--eps-clip-c", "--dual-clip-c", "3"),
    ("--save-interval", "--save-every", "20"),
    ("--eval-interval", "--eval-every", "20"),
    ("--n-samples-per-eval-prompt", "--eval-samples", "16"),
    ("--eval-max-response-len", "--eval-max-new-tokens", "16384"),
    ("--lr-decay-style", "--lr-schedule", "cosine"),
    ("--clip-grad", "--grad-clip", "0.5"),
    ("--num-steps-per-rollout", "--updates-per-step", "2"),
    ("--tis-clip", "--tis-cap", "3"),
    ("--tis-clip-low", "--tis-floor", "0.5"),
    ("--lambd", "--lam", "1.0"),
    ("--kl-loss-type", "--kl-estimator", "k1"),
]


@pytest.mark.parametrize("slime, vime, value", SAME_MEANING)
def test_slime_names_set_the_same_settings(slime, vime, value):
    assert parse(slime, value) == parse(vime, value) != parse()


def test_switches_and_slime_names_vime_already_had():
    assert parse("--apply-chat-template").data.chat_template and not parse().data.chat_template
    assert parse("--apply-chat-template") == parse("--chat-template")
    # the same names in both: nothing to alias, the meaning checked against slime's
    config = parse("--entropy-coef", "0.01", "--kl-loss-coef", "0.02", "--eval-top-p", "0.7", "--lr", "1e-6",
                   "--weight-decay", "0.1", "--adam-beta2", "0.98", "--rollout-batch-size", "32")
    assert (config.loss.entropy_coef, config.loss.kl_loss_coef, config.eval.eval_top_p) == (0.01, 0.02, 0.7)
    assert (config.optim.lr, config.optim.weight_decay, config.optim.adam_beta2) == (1e-6, 0.1, 0.98)


def test_eps_clip_alone_is_symmetric_as_in_slime():
    """slime's eps_clip_high defaults to eps_clip; vime's --clip-high has a default of its own (a scenario's: 0.28
    in the DAPO ones), so --eps-clip alone sets both bounds, and vime's own --clip-low only the floor."""
    dapo = RunConfig().replace(clip_high=0.28)
    alone = parse("--eps-clip", "0.3", defaults=dapo).loss
    assert (alone.clip_low, alone.clip_high) == (0.3, 0.3)
    both = parse("--eps-clip", "0.2", "--eps-clip-high", "0.28").loss
    assert (both.clip_low, both.clip_high) == (0.2, 0.28)
    mixed = parse("--eps-clip", "1e-4", "--clip-high", "2e-4").loss
    assert (mixed.clip_low, mixed.clip_high) == (1e-4, 2e-4)
    vime_floor = parse("--clip-low", "0.3", defaults=dapo).loss
    assert (vime_floor.clip_low, vime_floor.clip_high) == (0.3, 0.28)


def test_rollout_top_k_minus_one_is_off():
    """slime's --rollout-top-k -1 (its default) means no top-k filter, which vime writes as 0; vime's own --top-k
    keeps refusing a negative value, with a message naming slime's spelling."""
    assert parse("--rollout-top-k", "-1").sampling.top_k == 0
    with pytest.raises(ValueError, match="top_k must be >= 0 .*slime's --rollout-top-k spells -1"):
        parse("--top-k", "-1")


def test_a_schedule_vime_lacks_is_refused_by_name(capsys):
    for style in ("constant", "linear", "cosine"):
        assert parse("--lr-decay-style", style).optim.lr_schedule == style
    for style in ("WSD", "inverse-square-root"):
        with pytest.raises(SystemExit):
            parse("--lr-decay-style", style)
        assert f"--lr-schedule/--lr-decay-style: invalid choice: '{style}'" in capsys.readouterr().err


def test_help_shows_each_alias_beside_its_setting():
    result = run("vime.scenario", "arithmetic", "--help")
    assert result.returncode == 0
    shown = " ".join(result.stdout.split())  # argparse wraps long lines
    for slime, vime, _ in SAME_MEANING:
        assert re.search(rf"{vime} \S+, {slime} ", shown), f"--help shows no {slime} beside {vime}"
    assert "--chat-template, --no-chat-template, --apply-chat-template, --no-apply-chat-template" in shown


MEGATRON = ("--train-backend", "megatron")


def test_data_parallel_size_is_derived_from_the_trainer_gpus():
    """Megatron's rule: the trainer's GPUs over tensor x pipeline x context parallel (vime: no context parallel)."""
    job = parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2").job
    assert (job.tensor_model_parallel_size, job.data_parallel_size, job.trainer_ranks) == (2, 4, 8)
    staged = parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2").job
    assert (staged.data_parallel_size, staged.trainer_ranks) == (2, 8)
    with pytest.raises(ValueError, match="GPUs do not split into copies of --tensor-model-parallel-size 2 x "
                                         "--pipeline-model-parallel-size 3 GPUs each"):
        parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "3")
    assert parse(*MEGATRON, "--actor-num-gpus-per-node", "8").job.data_parallel_size == 8
    # slime's Qwen3-30B-A3B layout: 8 GPUs, TP 4, experts over all 8 ranks; no --data-parallel-size needed
    moe = parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4",
                "--expert-model-parallel-size", "8").job
    assert (moe.data_parallel_size, moe.expert_model_parallel_size) == (2, 8)
    # given, it is checked against the GPUs; on CPU (no trainer GPUs) it is taken as given
    assert parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
                 "--data-parallel-size", "4").job.data_parallel_size == 4
    assert parse(*MEGATRON, "--tensor-model-parallel-size", "2", "--data-parallel-size", "2").job.trainer_ranks == 4
    assert parse(*MEGATRON, "--tensor-model-parallel-size", "2").job.data_parallel_size == 1


def test_a_data_parallel_size_the_gpus_do_not_give_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"--data-parallel-size 2 x --tensor-model-parallel-size 2 ranks, one per "
                                         r"GPU, but the trainer has 8 .*leave --data-parallel-size out .*\(4\)"):
        parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
              "--data-parallel-size", "2")
    with pytest.raises(ValueError, match=r"--actor-num-gpus-per-node 6: the trainer's 6 GPUs do not split into "
                                         r"copies of --tensor-model-parallel-size 4"):
        parse(*MEGATRON, "--actor-num-gpus-per-node", "6", "--tensor-model-parallel-size", "4")


def test_the_expert_parallel_error_names_the_flag_to_change():
    # the 30B layout without GPUs (gloo on CPU): the data-parallel size is the fix
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size 8: .*for 8 ranks sharing the experts "
                                         r"pass --data-parallel-size 2, or pass --expert-model-parallel-size 1, 4"):
        parse(*MEGATRON, "--tensor-model-parallel-size", "4", "--expert-model-parallel-size", "8")
    # with GPUs the data-parallel size follows from them: the GPU count is the fix
    with pytest.raises(ValueError, match=r"for 8 ranks sharing the experts give the trainer 8 GPUs "
                                         r"\(--actor-num-gpus-per-node 8;"):
        parse(*MEGATRON, "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4",
              "--expert-model-parallel-size", "8")
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size 3: .*pass --expert-model-parallel-size "
                                         r"1, 4, 8$"):
        parse(*MEGATRON, "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4",
              "--expert-model-parallel-size", "3")


def test_layout_flags_asking_for_what_vime_does_are_accepted():
    given = parse("--pipeline-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
                  "--rollout-shuffle", "--balance-data")
    assert given == parse()


def test_features_vime_lacks_are_refused_together(tmp_path):
    """slime's Qwen3-30B-A3B recipe's performance and optimizer flags, with context parallelism added: one message
    names every flag to drop and what vime lacks for it (a trainer on several hosts is no longer one of them); no
    run folder is left."""
    flags = ["--context-parallel-size", "2", "--sequence-parallel",
             "--optimizer-cpu-offload",
             "--overlap-cpu-optimizer-d2h-h2d", "--use-precision-aware-optimizer", "--moe-enable-deepep",
             "--critic-num-gpus-per-node", "4"]
    with pytest.raises(ValueError) as refused:
        parse(*flags, "--actor-num-nodes", "8")
    said = str(refused.value)
    assert "--actor-num-nodes" not in said
    for expected in ("--context-parallel-size 2 (context "
                     "parallelism)", "--optimizer-cpu-offload, "
                     "--overlap-cpu-optimizer-d2h-h2d (offloading of the optimizer state to the CPU)",
                     "--use-precision-aware-optimizer (", "--moe-enable-deepep (DeepEP",
                     "--critic-num-gpus-per-node 4 (PPO's value model on GPUs of its own"):
        assert expected in said, said
    assert "--sequence-parallel" not in said
    result = run("vime.scenario", "arithmetic", *flags, "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "vime does not have what these flags ask for yet" in result.stderr
    assert not (tmp_path / "run").exists()


def test_dynamic_batch_size_is_a_token_budget_setting():
    """slime's --use-dynamic-batch-size --max-tokens-per-gpu T are vime's settings of the same names; either alone
    is refused, naming the other (slime asserts the budget with the switch, and reads the budget only with it)."""
    optim = parse("--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216").optim
    assert (optim.use_dynamic_batch_size, optim.max_tokens_per_gpu) == (True, 9216)
    assert (parse().optim.use_dynamic_batch_size, parse().optim.max_tokens_per_gpu) == (False, 0)
    for flags, named in ((["--use-dynamic-batch-size"], "pass --max-tokens-per-gpu T"),
                         (["--max-tokens-per-gpu", "9216"], "only with --use-dynamic-batch-size")):
        with pytest.raises(ValueError, match=named):
            parse(*flags)


def test_the_readme_table_lists_the_aliases_there_are():
    """README's "Coming from slime": each row's slime flag is a second name of the vime setting beside it, and every
    alias tested here is in the table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Coming from slime"):]
    section = section[:section.index("\n## ")]
    rows = re.findall(r"^\| `(--[\w-]+)` \| `(--[\w-]+)` \|", section, flags=re.MULTILINE)
    spellings = {}  # each flag of a setting: all of that setting's flags
    for part in dataclasses.fields(RunConfig):
        for field in dataclasses.fields(part.default.__class__):
            spellings.update(dict.fromkeys(flags_of(field), flags_of(field)))
    for slime, vime in rows:
        assert slime in spellings.get(vime, ()), f"README: {slime} is no name of {vime}'s setting"
    assert {slime for slime, _, _ in SAME_MEANING} | {"--eps-clip", "--apply-chat-template", "--custom-rm-path"} == {
        s for s, _ in rows}
    same_names = section[section.index("These have the same name in both"):section.index("As in\nMegatron")]
    for flag in re.findall(r"`(--[\w-]+)`", same_names):
        assert flag in spellings, f"README: {flag} is no vime flag"


@pytest.fixture(scope="module")
def config_and_tokenizer_only(tmp_path_factory) -> Path:
    """A model folder as --dry-run needs it: config.json and the tokenizer, the weights removed."""
    from scenarios.arithmetic import build_model

    folder = tmp_path_factory.mktemp("dry") / "model"
    build_model(folder, seed=0)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    return folder


SLIME_LAYOUT = ("--colocate", "--actor-num-gpus-per-node", "8", "--rollout-backend", "vllm", *MEGATRON,
                "--tensor-model-parallel-size", "2")


def test_dry_run_resolves_and_places_without_weights_or_run_folder(config_and_tokenizer_only, tmp_path):
    """slime's colocated layout planned for 8 GPUs this machine lacks: the data-parallel size derived (4), every
    engine on a trainer GPU and so served by CUDA IPC, exit 0; no run folder, no model loaded (there are no
    weights to load)."""
    result = run("vime.scenario", "arithmetic", "--dry-run", "--dry-run-gpus", "8", *SLIME_LAYOUT,
                 "--model-path", str(config_and_tokenizer_only), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout[:result.stdout.index("\nplacement on")])
    assert (resolved["job"]["data_parallel_size"], resolved["job"]["tensor_model_parallel_size"]) == (4, 2)
    assert resolved["rollout"]["rollout_workers"] == 8
    assert "placement on a host with 8 GPUs (--dry-run-gpus)" in result.stdout
    assert "trainer: GPUs 0,1,2,3,4,5,6,7 (megatron, 8 rank(s): tensor parallel 2 x data parallel 4)" in result.stdout
    assert "rollout worker 7: GPUs 7 (vllm, 1 GPU(s) per engine); weights by ipc" in result.stdout
    assert not (tmp_path / "run").exists()


def test_dry_run_refuses_what_the_run_would_with_the_reason(config_and_tokenizer_only, tmp_path):
    """Separate engines need GPUs beside the trainer's: 8 + 8 on a host of 8 is refused, exit 2, naming the
    count; with --dry-run-gpus alone (no --dry-run) nothing is planned either."""
    result = run("vime.scenario", "arithmetic", "--dry-run", "--dry-run-gpus", "8", *SLIME_LAYOUT[1:],
                 "--rollout-num-gpus", "8", "--model-path", str(config_and_tokenizer_only),
                 "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "this placement needs 16 GPUs (trainer 8, rollout 8) but this host shows " \
        "8" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()
    result = run("vime.scenario", "arithmetic", "--dry-run-gpus", "8", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "--dry-run-gpus plans a --dry-run; add --dry-run" in result.stderr
    assert not (tmp_path / "run").exists()


def test_dry_run_of_a_scenario_that_builds_its_model_builds_nothing(tmp_path):
    result = run("vime.scenario", "arithmetic", "--dry-run", "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert "the run would build a random tiny Qwen3 and its character-level tokenizer in" in result.stdout
    assert "nothing placed (no GPU flag given)" in result.stdout
    assert not (tmp_path / "run").exists()


def test_common_sglang_flags_become_vllm_ones_with_a_note():
    from vime.slime_flags import sglang_flags

    tokens, notes = sglang_flags(["--lr", "1e-6", "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs",
                                  "1", "2", "4", "8", "--sglang-max-running-requests=256",
                                  "--sglang-disable-cuda-graph", "--sglang-server-concurrency", "512",
                                  "--sglang-dp-size", "1"])
    assert tokens == ["--lr", "1e-6", "--vllm-gpu-memory-utilization", "0.7", "--vllm-cudagraph-capture-sizes", "1",
                      "2", "4", "8", "--rollout-max-batch-size", "256", "--vllm-enforce-eager"]
    said = "\n".join(notes)
    assert ("--sglang-mem-fraction-static 0.7 runs as --vllm-gpu-memory-utilization 0.7; the two fractions "
            "differ") in said
    assert "--sglang-server-concurrency 512 is dropped: slime's client-side cap" in said
    assert "--rollout-max-batch-size" in said.split("--sglang-server-concurrency")[1]
    found, rest = engine_flags(tokens)
    assert found == {"vllm_args": {"gpu_memory_utilization": 0.7, "cudagraph_capture_sizes": [1, 2, 4, 8],
                                   "enforce_eager": True}}
    assert parse(*rest).rollout.rollout_max_batch_size == 256


def test_other_sglang_flags_are_refused_together_with_what_to_pass():
    from vime.slime_flags import sglang_flags

    with pytest.raises(ValueError) as refused:
        sglang_flags(["--sglang-enable-dp-attention", "--sglang-dp-size", "4", "--sglang-ep-size", "8",
                      "--sglang-router-ip", "10.0.0.1", "--sglang-chunked-prefill-size", "-1",
                      "--sglang-attention-backend", "fa3"])
    said = str(refused.value)
    for expected in ("--sglang-enable-dp-attention (attention data parallelism inside an engine",
                     "--sglang-dp-size 4 (attention data parallelism", "--sglang-ep-size 8 (an expert-parallel size "
                     "inside an engine: vLLM takes none; --vllm-enable-expert-parallel true",
                     "--sglang-router-ip 10.0.0.1 (slime's SGLang router", "--sglang-chunked-prefill-size -1 (pass "
                     "--vllm-max-num-batched-tokens N (for -1: --vllm-enable-chunked-prefill false))",
                     "--sglang-attention-backend fa3 (pass the vLLM engine argument that does the same, as "
                     "--vllm-NAME)"):
        assert expected in said, said
    with pytest.raises(ValueError, match=r"--sglang-mem-fraction-static 0.7 \(given as "
                                         r"--vllm-gpu-memory-utilization too: pass one of them\)"):
        sglang_flags(["--sglang-mem-fraction-static", "0.7", "--vllm-gpu-memory-utilization=0.5"])


def test_sglang_flags_on_the_command_line(tmp_path):
    """Translated as the run reads them (--dry-run shows the engine arguments), notes on stderr; a refused one
    exits 2 before the run folder is made."""
    result = run("vime.scenario", "arithmetic", "--dry-run", "--rollout-backend", "vllm",
                 "--sglang-mem-fraction-static", "0.6", "--sglang-cuda-graph-bs", "1", "2", "4",
                 "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout[:result.stdout.index("\nplacement on")])
    assert resolved["rollout"]["vllm_args"] == {"gpu_memory_utilization": 0.6, "cudagraph_capture_sizes": [1, 2, 4]}
    assert "note: --sglang-cuda-graph-bs 1 2 4 runs as --vllm-cudagraph-capture-sizes 1 2 4" in result.stderr
    result = run("vime.scenario", "arithmetic", "--sglang-dp-size", "4", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "--sglang-dp-size 4 (attention data parallelism" in result.stderr
    assert not (tmp_path / "run").exists()


def test_global_batch_size_is_samples_per_optimizer_step():
    """slime's run-qwen3-4B: 32 prompts x 8 samples = 256 per rollout, --global-batch-size 256: one optimizer step;
    given with --num-steps-per-rollout, the two must agree."""
    step = ("--rollout-batch-size", "32", "--n-samples-per-prompt", "8")
    assert parse(*step, "--global-batch-size", "256").optim.updates_per_step == 1
    assert parse(*step, "--global-batch-size", "64").optim.updates_per_step == 4
    assert parse(*step, "--global-batch-size", "128", "--num-steps-per-rollout", "2").optim.updates_per_step == 2
    with pytest.raises(ValueError, match=r"--global-batch-size 256 x --num-steps-per-rollout 2 = 512 samples, but a "
                                         r"step trains --rollout-batch-size 32 x --n-samples-per-prompt 8 = 256 "
                                         r"samples: pass --global-batch-size 128"):
        parse(*step, "--global-batch-size", "256", "--num-steps-per-rollout", "2")
    with pytest.raises(ValueError, match=r"--global-batch-size 100: a step trains .* = 256 samples, which does not "
                                         r"split .*pass a divisor of 256"):
        parse(*step, "--global-batch-size", "100")


def test_kl_loss_follows_slime_when_spelled_as_slime_does():
    """slime adds --kl-loss-coef only with --use-kl-loss, and its --kl-loss-type defaults to k1; vime's own
    --kl-loss-coef alone keeps adding the loss (its --kl-estimator defaults to k3)."""
    loss = parse("--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl").loss
    assert (loss.kl_loss_coef, loss.kl_estimator) == (0.01, "low_var_kl")
    assert parse("--use-kl-loss", "--kl-loss-coef", "0.01").loss.kl_estimator == "k1"
    off = parse("--kl-loss-coef", "0.01", "--kl-loss-type", "k3").loss  # no --use-kl-loss: slime adds no KL loss
    assert (off.kl_loss_coef, off.kl_estimator) == (0.0, "k3")
    vime = parse("--kl-loss-coef", "0.01").loss
    assert (vime.kl_loss_coef, vime.kl_estimator) == (0.01, "k3")
    assert parse("--kl-loss-type", "k2", "--use-kl-loss") == parse("--kl-estimator", "k2", "--use-kl-loss")


def test_optimizer_adam_is_vimes_adamw_and_others_are_refused():
    assert parse("--optimizer", "adam", "--weight-decay", "0.1") == parse("--weight-decay", "0.1")
    with pytest.raises(ValueError, match=r"--optimizer sgd: vime trains with AdamW only, which is Megatron's adam"):
        parse("--optimizer", "sgd")


def test_megatron_recompute_flags_are_vimes_recompute_activations():
    """slime's --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 is what vime's
    --recompute-activations does; another value, or the method without the granularity, is refused naming it."""
    full = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert parse(*MEGATRON, *full) == parse(*MEGATRON, "--recompute-activations") != parse(*MEGATRON)
    assert parse(*MEGATRON, "--recompute-granularity", "full").job.recompute_activations
    with pytest.raises(ValueError, match=r"^--recompute-granularity selective, --recompute-num-layers 2: vime "
                                         r"recomputes whole layers, one per checkpoint"):
        parse(*MEGATRON, "--recompute-granularity", "selective", "--recompute-num-layers", "2")
    with pytest.raises(ValueError, match=r"^--recompute-method/--recompute-num-layers without "
                                         r"--recompute-granularity: vime recomputes"):
        parse(*MEGATRON, "--recompute-method", "uniform")


def test_rm_type_is_vimes_reward_where_one_does_the_same():
    for rm_type, reward in (("math", "math"), ("gsm8k", "gsm8k"), ("deepscaler", "deepscaler")):
        assert parse("--rm-type", rm_type).reward.reward == reward
    with pytest.raises(ValueError, match=r"--rm-type dapo: vime has no such reward; pass --reward math \(math-verify "
                                         r"reads DAPO's \"Answer:\" line too; slime's dapo scores a wrong answer -1"):
        parse("--rm-type", "dapo")
    with pytest.raises(ValueError, match=r"--rm-type remote_rm: .*pass --custom-rm-path module.function, a "
                                         r"custom_rm\(args, sample\)"):
        parse("--rm-type", "remote_rm")
    with pytest.raises(ValueError, match=r"--rm-type math is vime's --reward math, but --reward exact is given too"):
        parse("--rm-type", "math", "--reward", "exact")


def test_calculate_per_token_loss_is_token_aggregation():
    sequence = RunConfig().replace(loss_aggregation="sequence")
    assert parse("--calculate-per-token-loss", defaults=sequence).loss.loss_aggregation == "token"
    assert parse(defaults=sequence).loss.loss_aggregation == "sequence"
    with pytest.raises(ValueError, match=r"--calculate-per-token-loss is vime's --loss-aggregation token, but "
                                         r"--loss-aggregation sequence is given too"):
        parse("--calculate-per-token-loss", "--loss-aggregation", "sequence")


def test_deepscaler_scores_only_an_answer_after_the_thinking():
    from vime.rewards import deepscaler

    assert deepscaler("<think>it is \\boxed{3}</think> so \\boxed{4}", "4") == 1.0
    assert deepscaler("<think>it is \\boxed{4}</think> so \\boxed{3}", "4") == 0.0
    assert deepscaler("<think>it is \\boxed{4}", "4") == 0.0  # the thinking never closed


def test_deepscaler_reads_what_slimes_reads():
    """slime's rm_hub/deepscaler.py: what follows the LAST </think>, the answer from a \\boxed{} only, the
    ###Response fallback, and a boxed label by its contents."""
    from vime.rewards import deepscaler

    # two </think>: only what follows the last one counts
    assert deepscaler("<think>a</think> \\boxed{4} <think>b</think> so \\boxed{3}", "4") == 0.0
    assert deepscaler("<think>a</think> \\boxed{3} <think>b</think> so \\boxed{4}", "4") == 1.0
    assert deepscaler("<think>a</think> <think>b \\boxed{4}</think> so 4", "4") == 0.0  # boxed in the 2nd thinking
    assert deepscaler("<think>a</think> the answer is 4", "4") == 0.0  # unboxed
    assert deepscaler("<think>a</think> Answer: 4", "4") == 0.0
    assert deepscaler("\\boxed{4}", "4") == 0.0  # no </think>, no ###Response
    assert deepscaler("###Instruction 1+3 ###Response \\boxed{4}", "4") == 1.0
    assert deepscaler("</think> \\boxed{\\frac{1}{2}}", "\\boxed{0.5}") == 1.0
    assert deepscaler("</think> \\boxed{4}", "") == 0.0


def test_eval_prompt_data_takes_one_named_set():
    assert parse("--eval-prompt-data", "aime", "/data/aime.jsonl") == parse("--eval-data", "/data/aime.jsonl")
    with pytest.raises(ValueError, match=r"--eval-prompt-data aime a.jsonl math b.jsonl: vime takes one NAME PATH "
                                         r"pair: .*each row's data_source its set's name"):
        parse("--eval-prompt-data", "aime", "a.jsonl", "math", "b.jsonl")


def test_save_and_load_name_vimes_run_folder(tmp_path):
    """slime's --save DIR is the run folder; --load DIR beside it resumes a run already there, else starts one."""
    from vime.slime_flags import run_folder

    def folders(*flags: str, out=None, resume=None):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_flags(parser, RunConfig())
        return run_folder(parser.parse_args(list(flags)), out, resume)

    folder = tmp_path / "Qwen3-4B_slime"
    assert folders("--save", str(folder), "--load", str(folder))[:2] == (folder, None)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    out, resume, notes = folders("--save", str(folder), "--load", str(folder), "--ref-load", "/ckpt/torch_dist")
    assert (out, resume) == (None, folder)
    assert any("--ref-load /ckpt/torch_dist is not read: vime's starting and reference weights are "
               "--hf-checkpoint's" in note for note in notes)
    with pytest.raises(ValueError, match=r"--save .*Qwen3-4B_slime holds a vime run: add --load .* to continue it"):
        folders("--save", str(folder))
    with pytest.raises(ValueError, match=r"--load /a without --save /a: vime continues a run in its own folder"):
        folders("--load", "/a")
    with pytest.raises(ValueError, match=r"--save/--load name vime's run folder, as --out or --resume do"):
        folders("--save", "/a", out=Path("/b"))
    with pytest.raises(ValueError, match=r"^--save /a and --load /b are different folders: .*pass the same folder to "
                                         r"both \(--load /a\)"):
        folders("--save", "/a", "--load", "/b")
    # one folder spelled two ways (a trailing slash, as run-qwen3-4B.sh has, or a relative path) is the same folder
    assert folders("--save", f"{tmp_path}/new/", "--load", str(tmp_path / "x" / ".." / "new"))[0] == \
        Path(f"{tmp_path}/new/")


def test_use_tis_and_slimes_tis_levels():
    """slime's --use-tis is vime's truncated importance sampling (bounds 0 and 2 in both); its --tis-level names of
    the two sequence levels read as vime's."""
    loss = parse("--use-tis", "--tis-level", "geometric").loss
    assert (loss.off_policy_correction, loss.tis_level, loss.tis_cap, loss.tis_floor) == (
        "tis", "sequence-geometric", 2.0, 0.0)
    assert parse("--tis-level", "sequence").loss.tis_level == "sequence-product"
    assert parse("--use-tis") == parse("--off-policy-correction", "tis")
    with pytest.raises(ValueError, match=r"--use-tis is vime's --off-policy-correction tis, but "
                                         r"--off-policy-correction icepop is given too"):
        parse("--use-tis", "--off-policy-correction", "icepop")


def test_use_wandb_is_refused_with_the_missing_features_and_no_key_shown():
    with pytest.raises(ValueError) as refused:
        parse("--use-wandb", "--wandb-project", "slime-dev", "--wandb-key", "SECRET", "--optimizer-cpu-offload")
    said = str(refused.value)
    assert "--use-wandb (logging to Weights & Biases; vime's metrics go to RUN_DIR/metrics.jsonl" in said, said
    assert "--optimizer-cpu-offload (" in said and "--wandb-project" not in said and "SECRET" not in said, said


def test_wandb_settings_without_use_wandb_ask_for_nothing():
    """slime reads --wandb-project, --wandb-key, ... only with --use-wandb, and --wandb-mode disabled logs nothing:
    accepted, with a note naming them (no value: a key is a secret)."""
    from vime.slime_flags import wandb_notes

    def notes(*flags: str) -> list[str]:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_flags(parser, RunConfig())
        args = parser.parse_args(list(flags))
        from_flags(args, RunConfig())  # not refused
        return wandb_notes(args)

    assert notes("--wandb-project", "p", "--wandb-key", "SECRET") == [
        "--wandb-project, --wandb-key ignored: slime reads them only with --use-wandb (and vime lacks logging to "
        "Weights & Biases; vime's metrics go to RUN_DIR/metrics.jsonl and RUN_DIR/tensorboard)"]
    assert notes("--use-wandb", "--wandb-mode", "disabled") == [
        "--use-wandb --wandb-mode disabled logs nothing, in slime and in vime"]
    assert notes() == []
    with pytest.raises(ValueError, match=r"--use-wandb \(logging to Weights & Biases"):
        parse("--use-wandb", "--wandb-mode", "offline")




def test_colocate_says_it_keeps_vllm_awake_unless_sleep_mode_is_chosen(tmp_path):
    """slime's --colocate offloads the engine while the trainer steps, vime's keeps vLLM awake: the same flag with
    another meaning is said on the command line, unless the run chose with --vllm-enable-sleep-mode."""
    layout = ["--actor-num-gpus-per-node", "1", "--rollout-backend", "vllm", *MEGATRON, "--dry-run", "--out",
              str(tmp_path / "run")]
    note = "note: --colocate keeps each vLLM engine awake"
    cases = [(["--colocate", "--dry-run-gpus", "1"], True),
             (["--colocate", "--dry-run-gpus", "1", "--vllm-enable-sleep-mode", "true"], False),
             (["--dry-run-gpus", "2"], False)]
    for (flags, noted), (code, said) in zip(cases, scenario_mains([["arithmetic", *flags, *layout]
                                                                   for flags, _ in cases])):
        assert code == 0 and (note in said) == noted, (flags, said[-3000:])
