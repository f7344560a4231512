"""Rollout routing replay (R3) on the reference engines: the rollout records experts, the trainer replays them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from conftest import every_sample
from vime.backends import routing_replay
from vime.backends.base import SamplingParams, Sequence, collate
from vime.backends.hf import checkpoint_names, in_memory_names
from vime.backends.torch_rollout import TorchRolloutEngine
from vime.backends.torch_train import TorchTrainEngine
from vime.config import RunConfig
from vime.devtools.make_tiny_model import tiny_config

ARCHS = ["qwen3_moe", "glm4_moe"]
VOCAB = 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random model of each MoE family, weights spread widely so routing has near-ties to get wrong."""
    transformers.utils.logging.set_verbosity_error()
    made = {}
    for index, arch in enumerate(ARCHS):
        config = tiny_config(arch, VOCAB, pad_token_id=0, eos_token_id=1)
        if arch == "glm4_moe":
            config.routed_scaling_factor = 2.5
        model = transformers.AutoModelForCausalLM.from_config(config)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                noise = torch.randn(tensor.shape, generator=generator)
                tensor.copy_(1 + 0.3 * noise if "norm" in name else 0.1 * noise if "bias" in name else 0.15 * noise)
        made[arch] = tmp_path_factory.mktemp(arch)
        model.save_pretrained(made[arch])
    return made


def _generate(folder: Path, dtype: str, count: int = 24, tokens: int = 12) -> list[Sequence]:
    engine = TorchRolloutEngine(str(folder), dtype=dtype, seed=3, record_experts=True)
    params = SamplingParams(max_new_tokens=tokens, stop_token_ids=(1,))
    sequences = [Sequence(i, [2 + (i * 7 + j) % 60 for j in range(3 + i % 5)], params) for i in range(count)]
    engine.add(sequences)
    while engine.busy:
        engine.step()
    return sequences


def _trainer(folder: Path) -> TorchTrainEngine:
    run = RunConfig()
    return TorchTrainEngine(str(folder), algo="grpo", optim=run.optim, loss=run.loss, grpo_config=run.grpo,
                            ppo_config=run.ppo, temperature=1.0)


def _batch(sequences: list[Sequence], replay: bool):
    return collate([s.prompt_ids for s in sequences], [s.response_ids for s in sequences],
                   [s.logprobs for s in sequences], [s.versions for s in sequences], [0.0] * len(sequences),
                   list(range(len(sequences))), 0, [s.routed_experts for s in sequences] if replay else None)


def _logprob_diff(trainer: TorchTrainEngine, batch) -> float:
    logprobs, _ = trainer._response_logprobs(trainer.policy, batch, every_sample(batch))
    diff = (logprobs.detach() - batch.rollout_logprobs).abs() * batch.response_mask
    return float(diff.sum() / batch.response_mask.sum())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_rollout_records_the_experts_of_every_token_it_fed_the_model(folders, arch):
    sequences = _generate(folders[arch], "fp32", count=4)
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[arch]).eval()
    layers = len(routing_replay.moe_routers(model))
    assert layers == (2 if arch == "qwen3_moe" else 1)  # GLM's first layer is dense
    for sequence in sequences:
        ids = torch.tensor([sequence.prompt_ids + sequence.response_ids])
        with torch.no_grad(), routing_replay.recording(model) as routed:
            model(ids)
        full = routed[0]  # [tokens, layers, top_k] of one unpadded forward
        assert sequence.routed_experts.dtype == torch.int16
        assert sequence.routed_experts.shape == (ids.shape[1] - 1, layers, 2)
        # the same experts, up to the order of the top-k (ties aside, which random weights do not produce)
        assert torch.equal(sequence.routed_experts.sort(-1).values, full[:-1].sort(-1).values)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_forces_the_recorded_experts_and_keeps_the_router_trainable(folders, arch):
    sequences = _generate(folders[arch], "fp32", count=6)
    batch = _batch(sequences, replay=True)
    trainer = _trainer(folders[arch])
    assert _logprob_diff(trainer, batch) < 1e-5  # same weights, same precision
    with torch.no_grad():
        for router in routing_replay.moe_routers(trainer.policy):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(9)))
    free = _batch(sequences, replay=False)
    rows = every_sample(batch)
    recorded = batch.routed_experts.flatten(0, 1)
    with routing_replay.recording(trainer.policy) as routed:
        trainer._response_logprobs(trainer.policy, free, rows)
    known = recorded[:, 0, 0] >= 0
    assert not torch.equal(routed[0][known].sort(-1).values, recorded[known].sort(-1).values)
    with routing_replay.recording(trainer.policy) as routed:
        logprobs, _ = trainer._response_logprobs(trainer.policy, batch, rows)
    assert torch.equal(routed[0][known], recorded[known])
    (logprobs.sum()).backward()
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0
               for router in routing_replay.moe_routers(trainer.policy))


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_rollout_and_fp32_trainer_agree_better_with_replay(folders, arch):
    """The R3 claim on the reference engines: routing picked in bf16 replayed in fp32 lowers
    train_rollout_logprob_abs_diff (figures printed for the record)."""
    sequences = _generate(folders[arch], "bf16", count=48, tokens=16)
    trainer = _trainer(folders[arch])
    without = _logprob_diff(trainer, _batch(sequences, replay=False))
    with_r3 = _logprob_diff(trainer, _batch(sequences, replay=True))
    print(f"{arch}: train_rollout_logprob_abs_diff without R3 {without:.4f}, with R3 {with_r3:.4f}")
    assert with_r3 < 0.9 * without


def test_replay_refuses_experts_of_the_wrong_shape_and_dense_models(folders, tmp_path):
    trainer = _trainer(folders["qwen3_moe"])
    with pytest.raises(ValueError, match=r"must be \[tokens, 2 MoE layers, top_k\]"):
        with routing_replay.replaying(trainer.policy, torch.zeros(5, 1, 2, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="replayed experts cover 5 tokens"):
        with routing_replay.replaying(trainer.policy, torch.zeros(5, 2, 2, dtype=torch.int16)):
            trainer.policy(torch.ones(1, 4, dtype=torch.long))
    dense = tmp_path / "dense"
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3", VOCAB)).save_pretrained(dense)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        TorchRolloutEngine(str(dense), record_experts=True)
    with pytest.raises(ValueError, match="holds a qwen3: pass --no-use-rollout-routing-replay"):
        routing_replay.check_model_folder(dense)
    routing_replay.check_model_folder(folders["glm4_moe"])


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_names_split_fused_experts_and_back(folders, arch):
    """vLLM loads experts one by one, as checkpoints name them; the rollout engine takes them fused."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[arch])
    live = dict(model.named_parameters())
    named = checkpoint_names(live)
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in named)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in named
    saved = load_file(next(folders[arch].glob("*.safetensors")))
    assert {name: tuple(t.shape) for name, t in named.items()} == \
        {name: tuple(t.shape) for name, t in saved.items() if name in named}
    round_trip = in_memory_names(named)
    assert set(round_trip) == set(live) and all(torch.equal(round_trip[n], live[n]) for n in live)
