"""The CPU reference engines and what they stand on.

Rollout log-probs against an independent full forward and against the
trainer's recomputation (``train_rollout_logprob_abs_diff``), stopping,
weight versions, top-k/top-p, seeded sampling; GRPO, PPO, bf16 and
gradient accumulation in the trainer; config flags, prompt sources and
rewards. Every model is a tiny random Qwen3 built in a temp folder by the
arithmetic scenario: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vime.rewards
from vime.algorithms.grpo import GRPOConfig
from vime.algorithms.policy_loss import PolicyLossConfig
from vime.algorithms.ppo import PPOConfig
from vime.backends import hf
from vime.backends.base import SamplingParams, Sequence, TensorBatch, collate
from vime.backends.hf import DTYPES, load_tokenizer, scaled_logprobs, token_stats
from vime.backends.packing import SampleSizes
from vime.backends.torch_rollout import TorchRolloutEngine, _top_k_top_p
from vime.backends.torch_train import TorchTrainEngine, micro_batches, replica_micro_batches
from vime.config import ActorStart, OptimConfig, RunConfig, add_flags, engine_flags, from_flags
from vime.data import PromptSource, check_prompting, load_rows, prompt_ids
from vime.devtools.shared_data import shared_data
from vime.scenarios.arithmetic import build_model
from vime.seeds import actor_seed, sampling_seed

VOCAB = 16  # the arithmetic tokenizer: 4 specials, 10 digits, "+" and "="


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Qwen3 folder, its eos id, and prompts of different lengths."""
    folder = tmp_path_factory.mktemp("model")
    eos = build_model(folder, seed=0)
    tokenizer = load_tokenizer(folder)
    prompts = [tokenizer(text)["input_ids"] for text in ("1+2=", "12+3+45=", "7=", "3+3+3=")]
    assert len({len(p) for p in prompts}) == len(prompts)  # left padding must actually happen
    return str(folder), eos, prompts


def generate(engine: TorchRolloutEngine, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
    """Run ``prompts`` to completion; the sequences in prompt order."""
    per_row = params if isinstance(params, list) else [params] * len(prompts)
    sequences = [Sequence(index, prompt, p) for index, (prompt, p) in enumerate(zip(prompts, per_row))]
    engine.add(sequences)
    for _ in range(100):
        if not engine.busy:
            break
        engine.step()
    assert not engine.busy and all(s.finish_reason for s in sequences)
    return sequences


@torch.no_grad()
def full_forward_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                          temperatures: list[float]) -> list[torch.Tensor]:
    """Per-token log-probs of each response from ONE forward over prompt + response, written here
    independently of the engines: right padding, positions from the mask, no KV cache."""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = torch.tensor(row)
        mask[index, :len(row)] = 1
    logits = model(input_ids=ids, attention_mask=mask, position_ids=mask.cumsum(-1) - 1).logits.float()
    result = []
    for index, (prompt, response) in enumerate(zip(prompts, responses)):
        start = len(prompt)
        predicting = logits[index, start - 1:start - 1 + len(response)] / temperatures[index]
        result.append(torch.log_softmax(predicting, -1).gather(-1, torch.tensor(response).unsqueeze(1)).squeeze(1))
    return result


def train_engine(folder: str, *, algo: str = "grpo", temperature: float = 1.0, dtype: str = "fp32",
                 loss: PolicyLossConfig | None = None, **optim) -> TorchTrainEngine:
    optim = {"lr": 1e-3, "updates_per_step": 1, **optim}
    return TorchTrainEngine(folder, algo=algo, optim=OptimConfig(**optim), loss=loss or PolicyLossConfig(),
                            grpo_config=GRPOConfig(), ppo_config=PPOConfig(), temperature=temperature, dtype=dtype)


def hand_batch(prompt: list[int], responses: list[list[int]], rewards: list[float],
               group_ids: list[int]) -> TensorBatch:
    """A batch of made-up responses (rollout log-probs 0, all from weight version 0)."""
    return collate([prompt] * len(responses), responses, [[0.0] * len(r) for r in responses],
                   [[0] * len(r) for r in responses], rewards, group_ids, pad_token_id=0)


# -- rollout engine ---------------------------------------------------------------------------------------------


def test_rollout_logprobs_equal_one_full_forward(model):
    folder, eos, prompts = model
    engine = TorchRolloutEngine(folder, seed=1)
    # per-row temperatures, and stop tokens so that responses end at different steps
    temperatures = [0.7, 1.3, 0.7, 0.5]
    params = [SamplingParams(temperature=t, max_new_tokens=6, stop_token_ids=(eos, 7)) for t in temperatures]
    sequences = generate(engine, prompts, params)
    assert max(len(s.response_ids) for s in sequences) > 1
    expected = full_forward_logprobs(engine.model, prompts, [s.response_ids for s in sequences], temperatures)
    for sequence, reference in zip(sequences, expected):
        diff = (torch.tensor(sequence.logprobs) - reference).abs().max().item()
        assert diff <= 1e-5, (sequence.request_id, diff)


def test_trainer_recomputes_the_rollout_logprobs(model):
    folder, eos, prompts = model
    temperature = 0.7
    rollout = TorchRolloutEngine(folder, seed=2)
    params = SamplingParams(temperature=temperature, max_new_tokens=5, stop_token_ids=(eos, 7, 9))
    sequences = generate(rollout, prompts, params)
    assert len({len(s.response_ids) for s in sequences}) > 1  # right padding of responses is exercised too
    assert all(version == 0 for s in sequences for version in s.versions)  # the trainer is at version 0 too

    def batch(shift: float) -> TensorBatch:
        return collate([s.prompt_ids for s in sequences], [s.response_ids for s in sequences],
                       [[lp + shift for lp in s.logprobs] for s in sequences], [s.versions for s in sequences],
                       [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1], pad_token_id=0)

    metrics = train_engine(folder, temperature=temperature, micro_batch_size=3).train_step(batch(0.0))
    assert metrics["train_rollout_logprob_abs_diff"] <= 1e-5
    # the figure really compares the tokens: logprobs off by 0.25 are reported as such
    shifted = train_engine(folder, temperature=temperature).train_step(batch(0.25))
    assert shifted["train_rollout_logprob_abs_diff"] == pytest.approx(0.25, abs=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])  # cuda: compiled
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_token_stats_are_the_log_softmax_s_in_value_and_gradient(device, entropy_grad):
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 1000, device=device) * 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 1000, (3, 5), device=device)
    weights = torch.randn(3, 5, device=device, dtype=torch.float64)
    exact = logits.detach().double().requires_grad_()
    logprobs = torch.log_softmax(exact / 0.7, dim=-1)
    want_chosen = logprobs.gather(-1, targets[..., None]).squeeze(-1)
    want_entropy = -(logprobs.exp() * logprobs).sum(-1)
    chosen, entropy = token_stats(logits, targets, 0.7, entropy_grad=entropy_grad)
    assert chosen.dtype == entropy.dtype == torch.float32 and entropy.requires_grad == entropy_grad
    torch.testing.assert_close(chosen.double(), want_chosen, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=1e-4)
    ((chosen * weights).sum() + (entropy.sum() if entropy_grad else 0)).backward()
    ((want_chosen * weights).sum() + (want_entropy.sum() if entropy_grad else 0)).backward()
    torch.testing.assert_close(logits.grad.double(), exact.grad, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scaled_logprobs_of_bf16_logits_are_the_fp32_log_softmax(device, temperature):
    """At temperature 1 the softmax reads the bf16 logits itself (no fp32 copy); values and gradients are those
    of the fp32 formula either way."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 1000, device=device) * 4).to(torch.bfloat16).requires_grad_()
    weights = torch.randn(3, 5, 1000, device=device)
    ours = scaled_logprobs(logits, temperature)
    wanted = torch.log_softmax(logits.float() / temperature, dim=-1)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, wanted, rtol=0, atol=1e-6)
    gradient, = torch.autograd.grad((ours * weights).sum(), logits)
    wanted_gradient, = torch.autograd.grad((wanted * weights).sum(), logits)
    assert gradient.dtype == torch.bfloat16
    torch.testing.assert_close(gradient, wanted_gradient, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_saved_checkpoint_reloads_with_identical_logits_and_resumes_the_same(model, tmp_path, dtype):
    """In bf16 the Hugging Face folder holds the rounded weights; resuming also needs the fp32 masters."""
    from transformers import AutoModelForCausalLM

    folder, _, prompts = model
    batch = hand_batch(prompts[0], [[3, 4], [5], [6, 7]], [1.0, 0.0, 0.5], [0, 0, 0])
    engine = train_engine(folder, algo="ppo", lr_schedule="cosine", dtype=dtype)
    engine.train_step(batch)
    engine.save_hf(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=DTYPES[dtype]).eval()
    ids = torch.tensor([prompts[0] + [3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, engine.policy.eval()(ids).logits)
    engine.save(tmp_path / "ckpt")
    resumed = train_engine(folder, algo="ppo", lr_schedule="cosine", dtype=dtype)
    resumed.load(tmp_path / "ckpt")
    assert resumed.weight_version == 1
    after, again = engine.train_step(batch), resumed.train_step(batch)
    assert after == again  # optimizer moments, schedule and value model came back too
    for (name, param), (_, other) in zip(engine.policy.named_parameters(), resumed.policy.named_parameters()):
        assert torch.equal(param, other), name


def test_stop_token_and_length_limit(model):
    folder, _, prompts = model
    engine = TorchRolloutEngine(folder)
    stops = tuple(range(VOCAB))  # whatever is sampled first is a stop token
    stopping = Sequence(0, prompts[0], SamplingParams(max_new_tokens=4, stop_token_ids=stops))
    running = Sequence(1, prompts[1], SamplingParams(max_new_tokens=3))
    engine.add([stopping, running])
    assert engine.busy
    assert engine.step() == [stopping]
    assert stopping.finish_reason == "stop" and len(stopping.response_ids) == 1
    assert stopping.response_ids[0] in stops  # the stop token is part of the response
    assert engine.step() == []
    assert engine.step() == [running]
    assert running.finish_reason == "length" and len(running.response_ids) == 3 == len(running.logprobs)
    assert len(stopping.response_ids) == len(stopping.logprobs) == 1  # nothing appended after finishing
    assert not engine.busy and engine.step() == []


def test_versions_follow_load_weights_and_bad_weight_sets_are_refused(model):
    folder, _, prompts = model
    engine = TorchRolloutEngine(folder)
    sequences = [Sequence(i, p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts[:2])]
    engine.add(sequences)
    engine.step()
    new_weights = {name: param.detach() + 0.01 for name, param in engine.model.named_parameters()}
    engine.load_weights(new_weights, version=3)
    engine.step()
    engine.step()
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, new_weights[name])
    missing = dict(new_weights)
    dropped = missing.pop(next(iter(missing)))
    with pytest.raises(ValueError, match=r"version 4 do not fit the model: missing \['"):
        engine.load_weights(missing, version=4)
    with pytest.raises(ValueError, match=r"unknown \['lm_head.extra'\]"):
        engine.load_weights({**new_weights, "lm_head.extra": dropped}, version=4)
    assert engine.weight_version == 3  # a refused set changes nothing
    engine.load_weights(new_weights, version=7)
    engine.step()
    for sequence in sequences:
        assert sequence.versions == [0, 3, 3, 7]
        assert len(sequence.response_ids) == len(sequence.logprobs) == 4


def test_sampling_params_are_checked():
    for bad in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_seeded_sampling_is_reproducible(model):
    folder, _, prompts = model
    params = SamplingParams(max_new_tokens=6)

    def run(seed: int) -> list[list[int]]:
        return [s.response_ids for s in generate(TorchRolloutEngine(folder, seed=seed), prompts, params)]

    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_a_seeded_sequence_samples_the_same_whatever_shares_its_batches(model):
    """What a response samples depends on its own seed only: alone, in one batch with the others in another
    order, or in batches of two. One stream for the whole batch made the demo give different rewards at the
    same --seed from its first step (the requests' arrival decides the batches). Mutation checked: drawing
    the rows from one engine-wide stream fails the first comparison."""
    folder, _, prompts = model
    params = SamplingParams(max_new_tokens=6)
    seeds = [sampling_seed(5, group_id=3, index=i) for i in range(len(prompts))]

    def run(order: list[int], max_batch_size: int) -> dict[int, list[int]]:
        engine = TorchRolloutEngine(folder, seed=99, max_batch_size=max_batch_size)
        sequences = [Sequence(i, prompts[i], params, seed=seeds[i]) for i in order]
        engine.add(sequences)
        while engine.busy:
            engine.step()
        return {s.request_id: s.response_ids for s in sequences}

    together = run(list(range(len(prompts))), 1024)
    assert run(list(reversed(range(len(prompts)))), 1024) == together
    assert run(list(range(len(prompts))), 2) == together
    assert {i: run([i], 1)[i] for i in range(len(prompts))} == together
    assert len({sampling_seed(5, 3, 0), sampling_seed(5, 3, 1), sampling_seed(5, 4, 0), sampling_seed(6, 3, 0)}) == 4


def test_every_actor_seed_derives_from_the_run_seed():
    """vime.seeds is the one place: the same values the driver used before it (so a --seed reproduces older
    runs), every rollout worker apart from the others."""
    assert [actor_seed(7, role) for role in ("router", "reward", "trainer", "buffer")] == [7, 7, 7, 7]
    assert [actor_seed(7, "rollout", index) for index in range(3)] == [1007, 1008, 1009]


# -- top-k / top-p ----------------------------------------------------------------------------------------------


def kept(filtered: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in filtered]


# a hand-made distribution, shuffled so that the sort and scatter back are exercised:
# by probability the order is token 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
HAND_MADE = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))


def test_top_k_one_keeps_only_the_argmax():
    logprobs = torch.log_softmax(torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    filtered = _top_k_top_p(logprobs, [1] * 5, [1.0] * 5)
    assert kept(filtered) == [{int(row.argmax())} for row in logprobs]
    best = logprobs.argmax(-1, keepdim=True)
    assert torch.equal(filtered.gather(1, best), logprobs.gather(1, best))  # the survivor is unchanged


@pytest.mark.parametrize(("top_p", "expected"), [(0.7, {1, 3}), (0.45, {1}), (0.9, {0, 1, 3}), (0.96, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, expected):
    filtered = _top_k_top_p(HAND_MADE.unsqueeze(0), [0], [top_p])
    assert kept(filtered) == [expected]
    assert torch.equal(filtered[0, list(expected)], HAND_MADE[list(expected)])


def test_top_p_counts_a_prefix_whose_mass_equals_p():
    assert kept(_top_k_top_p(HAND_MADE.unsqueeze(0), [0], [0.5])) == [{1}]


def test_rows_with_different_settings_in_one_batch():
    rows = HAND_MADE.expand(5, -1)
    filtered = _top_k_top_p(rows, [1, 0, 3, 2, 0], [1.0, 0.7, 0.45, 0.96, 0.9])
    assert kept(filtered) == [{1}, {1, 3}, {1}, {1, 3}, {0, 1, 3}]
    assert _top_k_top_p(rows, [0] * 5, [1.0] * 5) is rows  # nothing to filter: untouched


def test_a_row_without_filters_passes_unchanged_beside_one_with_filters():
    peaked = torch.log_softmax(torch.tensor([20.0, 0.0, -5.0, -30.0]), -1)
    filtered = _top_k_top_p(peaked.expand(2, -1), [1, 0], [1.0, 1.0])
    assert kept(filtered) == [{0}, {0, 1, 2, 3}]
    assert torch.equal(filtered[1], peaked)


# -- trainer ----------------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_logprob(policy: torch.nn.Module, prompt: list[int], response: list[int]) -> float:
    return float(full_forward_logprobs(policy, [prompt], [response], [1.0])[0].sum())


def test_grpo_step_raises_the_logprob_of_the_rewarded_sample(model):
    folder, eos, prompts = model
    engine = train_engine(folder, micro_batch_size=4)
    responses = [[6, eos], [7, eos], [8, 9, eos], [10, eos]]
    batch = hand_batch(prompts[0], responses, [1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0])
    before = [sample_logprob(engine.policy, prompts[0], r) for r in responses]
    metrics = engine.train_step(batch)
    after = [sample_logprob(engine.policy, prompts[0], r) for r in responses]
    assert after[0] > before[0] + 1e-3, (before, after)
    assert sum(after[1:]) < sum(before[1:])
    assert engine.weight_version == 1 and math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_ppo_step_trains_the_value_model(model):
    folder, eos, prompts = model
    engine = train_engine(folder, algo="ppo")
    batch = hand_batch(prompts[1], [[6, eos], [7, 8, eos], [9]], [1.0, 0.0, 0.5], [0, 1, 2])
    metrics = engine.train_step(batch)
    assert math.isfinite(metrics["value_loss"]) and metrics["value_loss"] > 0
    assert math.isfinite(metrics["loss"]) and "vf_clipfrac" in metrics
    assert engine.critic.head.bias.abs().item() > 0  # the head starts at zero


def test_bf16_trains_bf16_weights_from_fp32_masters(model):
    """Updates smaller than bf16 can hold (Adam moves each weight by about lr) still land: the masters keep
    them, and the bf16 weights are always the masters rounded."""
    folder, eos, prompts = model
    engine = train_engine(folder, dtype="bf16", lr=1e-5)
    initial = [master.clone() for master in engine.masters.state_dict()]
    weights = dict(engine.policy.named_parameters())
    rounded = [param.detach().clone() for param in weights.values()]
    assert all(param.dtype == torch.bfloat16 for param in rounded)
    metrics = engine.train_step(hand_batch(prompts[2], [[6, eos], [7, eos]], [1.0, 0.0], [0, 0]))
    assert math.isnan(metrics.pop("train_rollout_logprob_abs_diff_stale"))  # every token is of this version
    assert all(math.isfinite(value) for value in metrics.values())
    masters = engine.masters.state_dict()
    assert all(master.dtype == torch.float32 for master in masters)
    moved = sum(int((master != before).sum()) for master, before in zip(masters, initial))
    visible = sum(int((param != before).sum()) for param, before in zip(weights.values(), rounded))
    assert moved > 0.5 * sum(master.numel() for master in masters)
    assert visible < 0.5 * moved  # most of the update is below a bf16 step, and not lost
    assert all(torch.equal(param, master.to(torch.bfloat16)) for param, master in zip(weights.values(), masters))
    assert all(param.grad is None for param in weights.values())  # gradients live on the masters only


@pytest.mark.parametrize("dtype,multiplies,warned", [("bf16", False, True), ("bf16", True, False),
                                                      ("fp32", False, False)])
def test_both_torch_engines_warn_of_bf16_on_a_cpu_that_emulates_it(model, monkeypatch, dtype, multiplies, warned):
    """Each torch engine says, as it is built, that bf16 on a CPU that cannot multiply it will crawl, and what to
    pass instead; not on a CPU that can, nor in fp32."""
    import structlog

    folder, _, _ = model
    monkeypatch.setattr(hf, "cpu_multiplies_bf16", lambda: multiplies)
    with structlog.testing.capture_logs() as logs:
        TorchRolloutEngine(folder, dtype=dtype)
        train_engine(folder, dtype=dtype)
    said = [entry for entry in logs if "cannot multiply bf16" in entry["event"]]
    assert len(said) == (2 if warned else 0), logs
    assert all("--dtype fp32" in entry["event"] and entry["log_level"] == "warning" for entry in said)


@pytest.mark.parametrize("updates", [1, 2])
def test_a_stale_token_already_past_the_clip_adds_no_gradient(model, updates):
    """Issue 30: a token sampled by older weights takes its PPO ratio against the log-probs it was sampled with.
    Here the policy has already moved each stale token past the clip in its advantage's direction (the rewarded
    response e times likelier than when sampled, the other e times less likely), so the step changes nothing;
    against the trainer's recomputed log-probs (--stale-ratio proximal, vime before) the ratio starts at 1 and
    the same tokens are pushed again. Fresh tokens are unaffected: with the same log-probs they train."""
    folder, eos, prompts = model
    responses, rewards = [[6, eos], [7, eos]], [1.0, 0.0]

    def moved(stale_ratio: str, sampled_version: int) -> tuple[float, float]:
        engine = train_engine(folder, updates_per_step=updates, micro_batch_size=1,
                              loss=PolicyLossConfig(stale_ratio=stale_ratio))
        engine.weight_version = 3
        batch = collate([prompts[0]] * 2, responses, [[0.0] * 2] * 2, [[sampled_version] * 2] * 2, rewards, [0, 0],
                        pad_token_id=0)
        trainer = engine.score(batch)["old_logprobs"]
        batch.rollout_logprobs = trainer + torch.tensor([[-1.0], [1.0]])  # past the clip (0.2) either way
        before = {name: tensor.clone() for name, tensor in engine.named_weights().items()}
        metrics = engine.train_step(batch)
        change = sum(float((tensor - before[name]).abs().sum()) for name, tensor in engine.named_weights().items())
        return change, metrics["pg_clipfrac"]

    assert moved("behaviour", sampled_version=1) == (0.0, 1.0)
    assert moved("proximal", sampled_version=1)[0] > 0
    assert moved("behaviour", sampled_version=3)[0] > 0


def test_bf16_kl_reference_starts_equal_to_the_policy(model):
    """The frozen reference holds the policy's bf16 weights and the same fp32 buffers (RoPE frequencies)."""
    folder, eos, prompts = model
    engine = TorchTrainEngine(folder, algo="grpo", optim=OptimConfig(), loss=PolicyLossConfig(kl_loss_coef=0.1),
                              grpo_config=GRPOConfig(), ppo_config=PPOConfig(), temperature=1.0, dtype="bf16")
    metrics = engine.train_step(hand_batch(prompts[2], [[6, 7, 8, eos], [7, eos]], [1.0, 0.0], [0, 0]))
    assert metrics["kl"] == 0.0


def test_resuming_a_bf16_run_needs_its_master_weights(model, tmp_path):
    folder, _, _ = model
    train_engine(folder).save(tmp_path)
    with pytest.raises(ValueError, match="holds no fp32 master weights .* --dtype fp32"):
        train_engine(folder, dtype="bf16").load(tmp_path)


def test_reported_losses_do_not_count_empty_mini_batches(model):
    folder, eos, prompts = model
    batch = hand_batch(prompts[0], [[7, 8, eos]], [1.0], [0])
    one = train_engine(folder, algo="ppo", updates_per_step=1).train_step(batch)
    two = train_engine(folder, algo="ppo", updates_per_step=2).train_step(batch)  # the same update, then an empty one
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)  # the training itself is the same
    assert two["value_loss"] == pytest.approx(one["value_loss"], rel=1e-5)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_one_update_per_batch_takes_its_scores_from_the_training_pass(model):
    """With one optimizer step and no KL reference, the no-grad scoring pass is skipped: the step must be the
    one the scored path takes. A KL term of weight 1e-9 forces that path and adds nothing: its gradient is 0
    while the policy equals the reference."""
    folder, eos, prompts = model
    responses = [[6], [7, eos], [8, 9, 10, eos], [11], [4, 5, eos], [12, 13, 6, 7, eos]]
    batch = collate([prompts[3]] * 6, responses, [[-2.5] * len(r) for r in responses],
                    [[0] * len(r) for r in responses], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 1, 1, 1],
                    pad_token_id=0)
    engines = [TorchTrainEngine(folder, algo="grpo", optim=OptimConfig(updates_per_step=1, micro_batch_size=4),
                                loss=PolicyLossConfig(kl_loss_coef=kl), grpo_config=GRPOConfig(),
                                ppo_config=PPOConfig(), temperature=0.7) for kl in (0.0, 1e-9)]
    assert engines[0].reference is None and engines[1].reference is not None
    for engine in engines:  # plain SGD, as in the accumulation test below: updates proportional to gradients
        engine.optimizer = torch.optim.SGD(engine.policy.parameters(), lr=0.1)
        engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    fused, scored = (engine.train_step(batch) for engine in engines)
    for key in ("train_rollout_logprob_abs_diff", "entropy", "loss", "grad_norm"):
        assert fused[key] == pytest.approx(scored[key], rel=1e-5), key
    assert fused["train_rollout_logprob_abs_diff"] > 0.1  # a real comparison: rollout log-probs are -2.5
    assert all(param.grad is None for param in engines[0].policy.parameters())  # no gradient held between steps
    for name, tensor in engines[1].named_weights().items():
        torch.testing.assert_close(engines[0].named_weights()[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def test_with_dropout_the_old_logprobs_come_from_a_pass_of_their_own(model, monkeypatch):
    """A training forward with dropout is not the policy's own: the scoring pass (eval mode) runs again."""
    folder, eos, prompts = model
    engine = train_engine(folder)
    passes = []
    monkeypatch.setattr(engine, "score", lambda batch, sizes: passes.append(batch) or
                        TorchTrainEngine.score(engine, batch, sizes))
    batch = hand_batch(prompts[0], [[6, eos], [7, eos]], [1.0, 0.0], [0, 0])
    engine.train_step(batch)
    assert not passes
    engine.policy.config.attention_dropout = 0.1
    engine.train_step(batch)
    assert len(passes) == 1


# a step's micro-batches: --micro-batch-size samples (padded rows), or a token budget (--use-dynamic-batch-size
# --max-tokens-per-gpu: packed rows): the prompt (7 tokens) with responses of 1 to 5 tokens is 8 to 12 tokens a
# sample, so 24 takes micro-batches of 2, 2 and 2 samples (12 + 11, 10 + 9, 8 + 8) and 20 those of 1, 1, 2 and 2
MICRO_BATCHINGS = {"4+2": {"micro_batch_size": 4}, "1x6": {"micro_batch_size": 1},
                   "24 tokens": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 24},
                   "20 tokens": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 20},
                   "5 tokens, each sample over": {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 5}}


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("micro_batching", MICRO_BATCHINGS.values(), ids=MICRO_BATCHINGS)
def test_micro_batches_accumulate_to_the_same_update(model, micro_batching, aggregation):
    folder, eos, prompts = model
    # responses of different lengths: micro-batches hold different token counts, so each must be
    # normalised by the whole mini-batch's count for the accumulated gradient to be the full one
    responses = [[6], [7, eos], [8, 9, 10, eos], [11], [4, 5, eos], [12, 13, 6, 7, eos]]
    batch = hand_batch(prompts[3], responses, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 1, 1, 1])
    # tis: a per-token figure that differs between micro-batches
    tis = PolicyLossConfig(off_policy_correction="tis", loss_aggregation=aggregation)
    whole = train_engine(folder, micro_batch_size=6, loss=tis)
    split = train_engine(folder, loss=tis, **micro_batching)
    assert len(split._micro_batches(torch.arange(6), SampleSizes.of(batch))) > 1
    # plain SGD for the comparison: AdamW's first step is about lr * sign(g), which turns float rounding
    # in near-zero gradients into lr-sized differences; SGD keeps the update proportional to the gradient
    for engine in (whole, split):
        engine.optimizer = torch.optim.SGD(engine.policy.parameters(), lr=0.1)
        engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
    initial = {name: tensor.clone() for name, tensor in whole.named_weights().items()}
    whole_metrics, split_metrics = whole.train_step(batch), split.train_step(batch)
    assert sorted(split_metrics) == sorted(whole_metrics) and "tis" in whole_metrics
    for key, value in whole_metrics.items():  # per-token figures weigh each micro-batch by its tokens
        assert split_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), key
    whole_weights, split_weights = whole.named_weights(), split.named_weights()
    assert max((whole_weights[name] - initial[name]).abs().max() for name in initial) > 1e-3
    for name, tensor in whole_weights.items():
        torch.testing.assert_close(split_weights[name], tensor, rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_hold_samples_of_similar_length_longest_first():
    lengths = [3, 9, 5, 9, 1, 6]
    mask = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    assert [rows.tolist() for rows in micro_batches(torch.arange(6), mask.sum(-1), 2)] == [[1, 3], [5, 2], [0, 4]]
    assert [rows.tolist() for rows in micro_batches(torch.tensor([4, 0, 5]), mask.sum(-1), 2)] == [[5, 0], [4]]


def test_token_budget_micro_batches_fit_and_hold_every_sample_once():
    """Seeded random mini-batches, budgets and data-parallel sizes: each copy's micro-batches that count hold its
    share of the samples, each once, longest first (its share in order, whole); each fits the budget in real
    tokens (its samples are packed into one row) or is one sample longer than the budget; each but a copy's
    last is full (its next sample would not fit), and every copy runs as many passes."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        samples = int(torch.randint(1, 40, (), generator=generator))
        lengths = torch.randint(1, 200, (samples + 5,), generator=generator)
        rows = torch.randperm(samples + 5, generator=generator)[:samples]
        budget = int(torch.randint(1, 800, (), generator=generator))
        replicas = int(torch.randint(1, 5, (), generator=generator))
        cuts = [replica_micro_batches(rows, lengths, 1, replica, replicas, max_tokens=budget)
                for replica in range(replicas)]
        assert len({len(cut) for cut in cuts}) == 1
        ordered = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
        for replica, cut in enumerate(cuts):
            counted = [chunk for chunk, counts in cut if counts]
            assert [chunk for chunk, counts in cut if not counts] == [ordered[-1:]] * (len(cut) - len(counted))
            assert torch.equal(torch.cat(counted) if counted else ordered[:0], ordered[replica::replicas])
            for index, chunk in enumerate(counted):
                tokens = int(lengths[chunk].sum())
                assert tokens <= budget or len(chunk) == 1, (chunk, lengths[chunk], budget)
                if index < len(counted) - 1:
                    assert tokens + int(lengths[counted[index + 1][0]]) > budget
    assert [chunk.tolist() for chunk in micro_batches(torch.arange(4), torch.tensor([9, 4, 5, 1]), 1,
                                                      max_tokens=10)] == [[0], [2, 1, 3]]


def test_data_parallel_copies_share_the_samples_and_run_as_many_passes():
    """Every sample counts in exactly one copy's micro-batches, the copies' shares alike in length; a copy
    with fewer samples pads with passes (over the shortest sample) that do not count, so that all run
    the same number of forward and backward passes."""
    lengths = torch.tensor([3, 9, 5, 9, 1, 6, 7])
    shares = [replica_micro_batches(torch.arange(7), lengths, 2, replica, 3) for replica in range(3)]
    assert [[(rows.tolist(), counted) for rows, counted in share] for share in shares] == [
        [([1, 5], True), ([4], True)], [([3, 2], True), ([4], False)], [([6, 0], True), ([4], False)]]
    one = replica_micro_batches(torch.arange(7), lengths, 2, 0, 1)
    assert [rows.tolist() for rows, _ in one] == [rows.tolist() for rows in micro_batches(torch.arange(7), lengths, 2)]
    few = [replica_micro_batches(torch.tensor([2]), lengths, 4, replica, 2) for replica in range(2)]
    assert [[(rows.tolist(), counted) for rows, counted in share] for share in few] == [[([2], True)], [([2], False)]]


def test_scores_come_back_in_the_batchs_order(model):
    """Scoring runs in length-sorted micro-batches; each row's log-probs must still land on that row."""
    folder, eos, prompts = model
    responses = [[8, eos], [4, 5, 6, 7, 8, 9, eos], [6], [7, 8, 9, 10, eos]]  # sorted: 1, 3, 0, 2
    batch = hand_batch(prompts[1], responses, [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1])
    together = train_engine(folder, micro_batch_size=2).score(batch)["old_logprobs"]
    for row, response in enumerate(responses):
        alone = train_engine(folder, micro_batch_size=2).score(hand_batch(prompts[1], [response], [0.0], [0]))
        torch.testing.assert_close(together[row, :len(response)], alone["old_logprobs"][0, :len(response)])
    with pytest.raises(ValueError, match="sizes of 1 samples for a batch of 4: pass SampleSizes.of"):
        train_engine(folder, micro_batch_size=2).score(batch, SampleSizes.of(hand_batch(prompts[1], responses[:1],
                                                                                         [0.0], [0])))


# -- config -----------------------------------------------------------------------------------------------------


def test_abort_drops_queued_sequences_and_stops_running_ones(model):
    folder, _, prompts = model
    engine = TorchRolloutEngine(folder, max_batch_size=2)
    sequences = [Sequence(i, p, SamplingParams(max_new_tokens=3)) for i, p in enumerate(prompts[:3])]
    engine.add(sequences)
    engine.step()  # rows 0 and 1 run; 2 waits for the next batch
    engine.abort([0, 2, 99])
    finished = []
    while engine.busy:
        finished += engine.step()
    assert finished == [sequences[1]] and sequences[1].finish_reason == "length"
    assert sequences[0].finish_reason == "abort" and len(sequences[0].response_ids) == 1
    assert sequences[2].response_ids == []
    engine.add([sequences[2]])
    engine.abort([2])
    assert not engine.busy


def test_flags_round_trip():
    defaults = RunConfig().replace(dynamic_sampling=True, group_size=4)
    parser = argparse.ArgumentParser()
    add_flags(parser, defaults)
    config = from_flags(parser.parse_args(["--lr", "3e-4", "--no-dynamic-sampling", "--stop-token-ids", "1", "2"]),
                        defaults)
    assert config.optim.lr == 3e-4
    assert config.data.dynamic_sampling is False
    assert config.sampling.stop_token_ids == (1, 2)
    assert config.data.group_size == 4  # a flag not given leaves the scenario's default
    assert config == defaults.replace(lr=3e-4, dynamic_sampling=False, stop_token_ids=(1, 2))
    assert from_flags(parser.parse_args([]), defaults) == defaults


def test_the_resume_checkpoint_travels_typed(tmp_path):
    """The trainer and the buffer of a resumed run get the checkpoint as a field of their start; a run's
    settings alone (config.json) start them afresh."""
    run = RunConfig().replace(lr=3e-4)
    start = ActorStart(run, resume_from=tmp_path / "checkpoints" / "step_4")
    assert ActorStart.from_dict(json.loads(json.dumps(start.to_dict()))) == start
    assert RunConfig.from_dict(start.to_dict()) == run
    assert ActorStart.from_dict(run.to_dict()) == ActorStart(run) and ActorStart(run).resume_from is None


def test_engine_flags_are_picked_out_of_the_command_line():
    found, rest = engine_flags(["--vllm-gpu-memory-utilization", "0.5", "--lr", "3", "--vllm-enforce-eager",
                                "--vllm-attention-backend=FLASH_ATTN", "--vllm-compilation-config", '{"level": 0}'])
    assert rest == ["--lr", "3"]
    assert found == {"vllm_args": {"gpu_memory_utilization": 0.5, "enforce_eager": True,
                                   "attention_backend": "FLASH_ATTN", "compilation_config": {"level": 0}}}
    config = RunConfig().replace(rollout_backend="vllm", **found)
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="apply to --rollout-backend vllm only"):
        RunConfig().replace(**found)


@pytest.mark.parametrize(("algo", "loss"), [
    ("gspo", PolicyLossConfig(dual_clip_c=3.0)),
    ("rloo", PolicyLossConfig(policy_loss="cispo", loss_aggregation="seq-mean-token-sum-norm", loss_scale_tokens=8)),
    ("reinforce_plus_plus", PolicyLossConfig(kl_coef=0.1, kl_estimator="low_var_kl", off_policy_correction="icepop",
                                             tis_floor=0.5)),
    ("reinforce_plus_plus_baseline", PolicyLossConfig(kl_coef=0.1, kl_loss_coef=0.1, kl_estimator="k2",
                                                      off_policy_correction="tis", tis_level="sequence-geometric",
                                                      loss_aggregation="seq-mean-token-sum")),
    ("ppo", PolicyLossConfig(kl_coef=0.1, off_policy_correction="tis", tis_floor=0.5)),
])
def test_every_estimator_trains_a_step_and_reports_its_fractions(model, algo, loss):
    """Each estimator with the losses and corrections of issue 31 through the engine's step: the statistics
    of each reach the step's metrics (the row of metrics.jsonl). The rollout log-probs of hand_batch are 0,
    far from the policy's: the corrections engage."""
    folder, eos, prompts = model
    engine = train_engine(folder, algo=algo, loss=loss, updates_per_step=2)
    assert engine.loss.ratio_level == ("sequence" if algo == "gspo" else "token")
    assert (engine.reference is not None) == bool(loss.kl_coef or loss.kl_loss_coef)
    metrics = engine.train_step(hand_batch(prompts[0], [[6, eos], [7, 8, eos], [9], [eos]], [1.0, 0.0, 0.5, 0.5],
                                           [0, 0, 1, 1]))
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    expected = {"pg_clipfrac"}
    if loss.dual_clip_c:
        expected.add("pg_clipfrac_lower")
    if engine.reference is not None:
        expected.add("kl")
    if loss.off_policy_correction != "none":
        expected |= {"tis", "tis_clipfrac" if loss.off_policy_correction == "tis" else "tis_maskfrac"}
    assert expected <= set(metrics), expected - set(metrics)
    if loss.off_policy_correction == "icepop":
        assert metrics["tis_maskfrac"] == 1.0  # every weight is e^(-2.x) or so, below the floor of 0.5


def test_advantage_estimator_and_algo_are_one_setting_and_kl_coef_changed_meaning(tmp_path):
    """--algo is another spelling of --advantage-estimator; --kl-coef with an estimator that has no reward
    to fold it into is refused with the new name of the loss term; a config.json written before the rename
    reads its kl_coef as the loss term it was."""
    parser = argparse.ArgumentParser()
    add_flags(parser, RunConfig())
    for flags, estimator in ((["--algo", "rloo"], "rloo"), (["--advantage-estimator", "reinforce_plus_plus"],
                                                            "reinforce_plus_plus"), ([], "grpo")):
        assert from_flags(parser.parse_args(flags), RunConfig()).job.algo == estimator
    with pytest.raises(ValueError, match="--kl-coef is the KL penalty folded into the reward.*pass --kl-loss-coef"):
        from_flags(parser.parse_args(["--kl-coef", "0.1"]), RunConfig())
    loss_term = from_flags(parser.parse_args(["--kl-loss-coef", "0.1"]), RunConfig())
    assert (loss_term.loss.kl_loss_coef, loss_term.loss.kl_coef) == (0.1, 0.0)
    old = RunConfig().to_dict()
    del old["loss"]["kl_loss_coef"]
    old["loss"]["kl_coef"] = 0.05
    assert RunConfig.from_dict(old).loss.kl_loss_coef == 0.05 and RunConfig.from_dict(old).loss.kl_coef == 0.0
    assert RunConfig().replace(algo="ppo", train_backend="megatron").job.train_backend == "megatron"
    with pytest.raises(ValueError, match="--critic-model-path initialises PPO's value model, which "
                                         "--advantage-estimator grpo has none of"):
        RunConfig().replace(critic_model_path="/some/critic")
    arguments = RunConfig().replace(max_new_tokens=7).train_engine_arguments(seed=0)
    assert arguments["loss"].loss_scale_tokens == 7  # Dr.GRPO's constant: the longest response generated


def test_config_dict_round_trip_and_unknown_names():
    config = RunConfig().replace(stop_token_ids=(2, 5), lr=1e-4, algo="ppo", dtype="bf16", kl_coef=0.1)
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(KeyError, match="no setting named 'learning_rate'"):
        config.replace(learning_rate=1e-4)


# -- data -------------------------------------------------------------------------------------------------------


ROWS = [{"prompt": f"{i}+0=", "label": str(i)} for i in range(20)]


def draw(source: PromptSource, count: int) -> list[dict | None]:
    return [source.next() for _ in range(count)]


def test_prompt_source_epochs_and_seeded_order():
    first = draw(PromptSource(ROWS, seed=3), 40)
    assert draw(PromptSource(ROWS, seed=3), 40) == first
    epoch_one, epoch_two = first[:20], first[20:]
    key = lambda row: row["label"]  # noqa: E731
    assert sorted(epoch_one, key=key) == sorted(epoch_two, key=key) == sorted(ROWS, key=key)  # each row once
    assert epoch_one != epoch_two and epoch_one != ROWS
    assert draw(PromptSource(ROWS, seed=4), 20) != epoch_one
    once = PromptSource(ROWS, seed=3, epochs=1)
    assert draw(once, 20) == epoch_one
    assert draw(once, 2) == [None, None]
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], seed=0)


def test_load_rows_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps(row) for row in ROWS[:3]) + "\n\n")
    assert load_rows(str(good)) == ROWS[:3]
    assert len(load_rows(custom_data_source="vime.scenarios.arithmetic:prompts")) == 55
    with pytest.raises(ValueError, match=r"pass --data FILE.jsonl \(or .parquet\) or --custom-data-source"):
        load_rows()
    with pytest.raises(ValueError, match=r"no such file; pass a JSONL or Parquet file"):
        load_rows(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "1+1=", "label": "2"}) + "\n")
    expected = f"{bad}:2: a prompt row must be a map with a 'prompt' (a string"
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_rows(str(bad))
    with pytest.raises(ValueError, match="expected package.module:function"):
        load_rows(custom_data_source="no_colon")


def test_rows_named_otherwise_are_mapped_with_the_input_and_label_keys(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "Tom has 3+4 apples?", "answer": "3+4=7\n#### 7", "id": 9}) + "\n")
    assert load_rows(str(data), input_key="question", label_key="answer") == [
        {"prompt": "Tom has 3+4 apples?", "label": "3+4=7\n#### 7", "id": 9}]
    with pytest.raises(ValueError, match=re.escape(f"{data}:1: the row has no --input-key 'problem'; "
                                                   "its keys are ['answer', 'id', 'question']")):
        load_rows(str(data), input_key="problem", label_key="answer")


def test_parquet_rows_with_conversations_and_nested_labels(tmp_path):
    """A verl-style Parquet file: the prompt a list of messages, the label inside reward_model."""
    import pyarrow
    import pyarrow.parquet

    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"{a}+{a}="}],
             "reward_model": {"ground_truth": str(2 * a), "style": "rule"}} for a in range(3)]
    data = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), data)
    loaded = load_rows(str(data), label_key="reward_model.ground_truth")
    assert [row["prompt"] for row in loaded] == [row["prompt"] for row in rows]
    assert [row["label"] for row in loaded] == ["0", "2", "4"]
    assert loaded[0]["data_source"] == "toy" and loaded[0]["reward_model"]["style"] == "rule"
    with pytest.raises(ValueError, match=re.escape("row 0: the row has no --label-key 'reward_model.answer'")):
        load_rows(str(data), label_key="reward_model.answer")
    not_parquet = tmp_path / "broken.parquet"
    not_parquet.write_text("{}")
    with pytest.raises(ValueError, match="not a Parquet file"):
        load_rows(str(not_parquet))


def test_prompts_with_a_template_and_the_chat_template(tmp_path):
    folder = tmp_path / "model"
    build_model(folder, seed=0, hidden_size=32, layers=1)
    tokenizer = load_tokenizer(str(folder))
    assert prompt_ids(tokenizer, "1+2=") == tokenizer("1+2=")["input_ids"]
    assert prompt_ids(tokenizer, "2", template="1+{prompt}=") == tokenizer("1+2=")["input_ids"]
    check_prompting(tokenizer, "Q: {prompt}", chat=False)
    with pytest.raises(ValueError, match=r"must contain \{prompt\}"):
        check_prompting(tokenizer, "no slot", chat=False)
    with pytest.raises(ValueError, match="has no chat template; leave the flag out"):
        check_prompting(tokenizer, "{prompt}", chat=True)
    qwen3 = shared_data() / "qwen3-tokenizer"
    if not (qwen3 / "tokenizer.json").is_file():
        pytest.skip(f"the Qwen3 tokenizer is not at {qwen3}; the chat-template half of this test needs it")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3))
    check_prompting(tokenizer, "{prompt}", chat=True)
    template = "Solve: {prompt}\nAnswer: $Answer"
    thinking = tokenizer.decode(prompt_ids(tokenizer, "1+1?", template=template, chat=True))
    assert thinking == "<|im_start|>user\nSolve: 1+1?\nAnswer: $Answer<|im_end|>\n<|im_start|>assistant\n"
    direct = tokenizer.decode(prompt_ids(tokenizer, "1+1?", template=template, chat=True, thinking=False))
    assert direct == thinking + "<think>\n\n</think>\n\n"
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    rendered = tokenizer.decode(prompt_ids(tokenizer, conversation, template=template, chat=True))
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n" + thinking
    assert conversation[1]["content"] == "1+1?"  # the row is not changed in place
    with pytest.raises(ValueError, match="needs --chat-template"):
        prompt_ids(tokenizer, conversation)
    with pytest.raises(ValueError, match="pass --chat-template"):
        check_prompting(tokenizer, "{prompt}", chat=False, rows=[{"prompt": conversation, "label": "2"}])


def test_a_line_that_is_not_json_is_reported_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n" + "{prompt: 1+1=}\n")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2")):
        load_rows(str(bad))


# -- rewards ----------------------------------------------------------------------------------------------------


def test_built_in_rewards():
    assert vime.rewards.exact(" 5\n", "5") == 1.0 and vime.rewards.exact("5.", "5") == 0.0
    assert vime.rewards.first_number("3 then 4", "3") == 1.0 and vime.rewards.first_number("3 then 4", "4") == 0.0
    assert vime.rewards.last_number("3 then 4", "4") == 1.0 and vime.rewards.last_number("3 then 4", "3") == 0.0
    assert vime.rewards.last_number("so it costs 1,000.50 dollars", "1000.5") == 1.0
    assert vime.rewards.first_number("it is -2", "-2") == 1.0
    assert vime.rewards.last_number("no number here", "4") == 0.0
    assert vime.rewards.last_number("4", "four") == 0.0


def test_resolve_built_in_and_custom_and_unknown():
    assert vime.rewards.resolve("first_number") is vime.rewards.first_number
    assert vime.rewards.resolve("exact", custom="vime.rewards:last_number") is vime.rewards.last_number
    with pytest.raises(ValueError, match=r"'nope' is not a built-in reward; choose one of .*--custom-reward"):
        vime.rewards.resolve("nope")
    with pytest.raises(ValueError, match="--custom-reward"):
        vime.rewards.resolve("exact", custom="vime.rewards:no_such_function")


async def test_score_calls_sync_and_async_rewards_and_checks_the_result():
    async def judged(response: str, label: str, **metadata) -> float:
        return 0.5 if metadata["strict"] else 1.0

    assert await vime.rewards.score(judged, "x", "y", {"strict": True}) == 0.5
    assert await vime.rewards.score(vime.rewards.exact, "7", "7", {"source": "test"}) == 1.0
    whole = await vime.rewards.score(lambda response, label: 1, "", "", {})
    assert whole == 1.0 and type(whole) is float
    for wrong in ("1.0", float("nan"), float("inf"), True, None):
        with pytest.raises(TypeError, match="must return a finite float"):
            await vime.rewards.score(lambda response, label, value=wrong: value, "", "", {})


def test_lr_schedules_warm_up_and_decay_to_the_floor():
    constant = OptimConfig()
    assert [constant.lr_factor(s, 10) for s in (0, 5, 10)] == [1.0, 1.0, 1.0]
    linear = OptimConfig(lr_schedule="linear", lr_min_ratio=0.2)
    assert [linear.lr_factor(s, 10) for s in (0, 5, 10, 20)] == pytest.approx([1.0, 0.6, 0.2, 0.2])
    cosine = OptimConfig(lr_schedule="cosine", lr_warmup_steps=3)
    assert [cosine.lr_factor(s, 13) for s in (0, 1, 2, 3, 8, 13)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 0.5, 0.0])
    refused = r"--lr-schedule \(or --lr-decay-style\) must be one of constant, linear, cosine, not 'step'"
    with pytest.raises(ValueError, match=refused):
        OptimConfig(lr_schedule="step")


_ROW = st.tuples(st.lists(st.integers(0, 999), max_size=6), st.lists(st.integers(0, 999), max_size=5),
                 st.booleans(), st.booleans())  # prompt, response, a loss mask given, routed experts given


@given(st.lists(_ROW, min_size=1, max_size=5), st.integers(-1, 3))
def test_collate_puts_each_samples_tokens_in_its_own_row_and_pads_the_rest(rows, pad) -> None:
    """collate fills the batch's rows from the samples end to end through masks (issue 36: a copy per row and
    field cost 0.1 s a step at TRL's sizes); every field of every row is checked here against its sample."""
    prompts, responses = [p for p, *_ in rows], [r for _, r, *_ in rows]
    logprobs = [[-0.5 * (i + 1)] * len(r) for i, r in enumerate(responses)]
    versions = [[i] * len(r) for i, r in enumerate(responses)]
    masks = [[(j + i) % 2 for j in range(len(r))] if masked else None
             for i, (_, r, masked, _) in enumerate(rows)]
    experts = [torch.full((len(p) + len(r), 2, 1), i, dtype=torch.int16) if routed else None
               for i, (p, r, _, routed) in enumerate(rows)]
    batch = collate(prompts, responses, logprobs, versions, [float(i) for i in range(len(rows))],
                    list(range(len(rows))), pad, routed_experts=experts, loss_masks=masks)
    width, longest = batch.input_ids.shape[1], batch.response_ids.shape[1]
    assert width == max(len(p) + len(r) for p, r in zip(prompts, responses))
    assert longest == max(len(r) for r in responses)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        length, rest, tail = len(prompt) + len(response), width - len(prompt) - len(response), longest - len(response)
        assert batch.input_ids[i].tolist() == prompt + response + [pad] * rest
        assert batch.attention_mask[i].tolist() == [1] * length + [0] * rest
        assert batch.response_start[i] == len(prompt)
        assert batch.response_ids[i].tolist() == response + [0] * tail
        assert batch.rollout_logprobs[i].tolist() == logprobs[i] + [0.0] * tail
        assert batch.versions[i].tolist() == versions[i] + [-1] * tail
        assert batch.response_mask[i].tolist() == (masks[i] or [1] * len(response)) + [0] * tail
        if any(e is not None for e in experts):
            expected = i if experts[i] is not None else -1
            assert batch.routed_experts[i, :length].eq(expected).all() and batch.routed_experts[i, length:].eq(-1).all()
        else:
            assert batch.routed_experts is None
    assert batch.rewards.tolist() == [float(i) for i in range(len(rows))]
