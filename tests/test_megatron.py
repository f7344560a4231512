"""The Megatron-core backend on CPU: weight conversion, log-prob parity with transformers, routing replay.

Each family vime trains (Qwen3 dense, tied and untied; Qwen3-MoE; GLM-4.5
MoE with attention biases, a shared expert, a dense first layer, an expert
score bias and a routed scaling factor) is built at toy size with random
weights spread wide enough that a wrong mapping shows: norms away from one,
logits far from uniform, routing decided by the weights. megatron-core runs
on CPU through ``vime.backends.cpu_compat``; nothing is downloaded.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install --no-deps "
                    "--ignore-requires-python megatron-core==0.19.2 triton==3.9.0")

import transformers  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron", "ignore::UserWarning:megatron")
from device_reads import DeviceReads  # noqa: E402
from forked_ranks import run_ranks  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402

from conftest import every_sample, plain_sgd, process_running  # noqa: E402
from vime.algorithms.grpo import GRPOConfig  # noqa: E402
from vime.algorithms.policy_loss import PolicyLossConfig  # noqa: E402
from vime.algorithms.ppo import PPOConfig  # noqa: E402
from vime.architecture import moe_layer_pattern  # noqa: E402
from vime.backends import megatron  # noqa: E402
from vime.backends.base import SamplingParams, Sequence, TensorBatch, collate  # noqa: E402
from vime.backends.hf import scaled_logprobs  # noqa: E402
from vime.backends.packing import SampleSizes, host_to_device, on_device, packed_inputs  # noqa: E402
from vime.backends.torch_rollout import TorchRolloutEngine  # noqa: E402
from vime.backends.torch_train import TorchTrainEngine  # noqa: E402
from vime.config import OptimConfig  # noqa: E402
from vime.devtools.make_tiny_model import tiny_config  # noqa: E402

VOCAB = 256
TEMPERATURE = 0.7
CASES = {  # name: (arch, changes to the tiny config)
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "glm4_moe": ("glm4_moe", {"attention_bias": True, "routed_scaling_factor": 2.5}),
}
MOE_CASES = ["qwen3_moe", "glm4_moe"]


def _hf_model(case: str) -> transformers.PreTrainedModel:
    arch, changes = CASES[case]
    config = tiny_config(arch, VOCAB)
    for key, value in changes.items():
        setattr(config, key, value)
    transformers.utils.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(sorted(CASES).index(case))
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            noise = torch.randn(tensor.shape, generator=generator)
            if "norm" in name:
                tensor.copy_(1 + 0.3 * noise)
            elif "e_score_correction_bias" in name:
                tensor.copy_(0.1 * noise)
            else:
                tensor.copy_(0.15 * noise)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[transformers.PreTrainedModel, dict[str, torch.Tensor], Path]]:
    """Each case's transformers model, its checkpoint tensors as ``save_pretrained`` writes them, and its folder."""
    from safetensors.torch import load_file

    models = {}
    for case in CASES:
        model = _hf_model(case)
        folder = tmp_path_factory.mktemp(case)
        model.save_pretrained(folder)
        models[case] = (model, load_file(folder / "model.safetensors"), folder)
    return models


def _megatron_model(hf_models, case: str, **kwargs) -> GPTModel:
    model, checkpoint, _ = hf_models[case]
    policy = megatron.build_model(model.config, **kwargs)
    megatron.load_hf_weights(policy, checkpoint, model.config)
    return policy.eval()


def _right_padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = [24, 17, 9]
    input_ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=generator)
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
    return input_ids * mask, mask


@pytest.mark.parametrize("case", CASES)
def test_hf_megatron_hf_round_trip_is_bit_exact(hf_models, case):
    model, checkpoint, _ = hf_models[case]
    back = megatron.hf_weights(_megatron_model(hf_models, case), model.config)
    assert sorted(back) == sorted(checkpoint)
    for name, tensor in checkpoint.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("case", CASES)
def test_logprobs_match_transformers_in_fp32(hf_models, case):
    model, _, _ = hf_models[case]
    policy = _megatron_model(hf_models, case)
    input_ids, mask = _right_padded_batch(seed=3)
    with torch.no_grad():
        ours = megatron.token_logprobs(megatron.forward(policy, input_ids).logits, input_ids, TEMPERATURE)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    theirs = scaled_logprobs(logits[:, :-1], TEMPERATURE).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    real = mask[:, 1:].bool()
    assert theirs[real].std() > 1.0  # far from uniform: a wrong mapping could not hide
    assert (ours - theirs)[real].abs().max() <= 1e-5


def _hf_experts(model: transformers.PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    """The experts transformers' routers choose: ``[batch, seq, moe_layers, top_k]``, as a rollout records them."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda module, args, output, index=index: chosen.__setitem__(index, output[2]))
        for index, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(input_ids=input_ids)
    for hook in hooks:
        hook.remove()
    return torch.stack([chosen[index].view(*input_ids.shape, -1) for index in sorted(chosen)], dim=2)


@pytest.mark.parametrize("case", MOE_CASES)
def test_recorded_experts_are_those_transformers_routes_to(hf_models, case):
    model, _, _ = hf_models[case]
    policy = _megatron_model(hf_models, case, routing_replay=True)
    input_ids, _ = _right_padded_batch(seed=4)
    with torch.no_grad():
        recorded = megatron.forward(policy, input_ids, record_experts=True).experts
    expected = _hf_experts(model, input_ids)
    assert recorded.shape == expected.shape
    assert torch.equal(recorded.sort(-1).values, expected.sort(-1).values)  # top-k order is not meaningful


def _routing_maps(policy) -> tuple[list[torch.Tensor], list]:
    maps: list[torch.Tensor] = []
    hooks = [module.register_forward_hook(lambda module, args, output: maps.append(output[1]))
             for module in policy.modules() if isinstance(module, TopKRouter)]
    return maps, hooks


@pytest.mark.parametrize("case", MOE_CASES)
def test_replay_forces_recorded_experts_after_the_router_changes(hf_models, case):
    model, _, _ = hf_models[case]
    policy = _megatron_model(hf_models, case, routing_replay=True)
    input_ids, _ = _right_padded_batch(seed=5)
    with torch.no_grad():
        recorded = megatron.forward(policy, input_ids, record_experts=True)
        for module in policy.modules():
            if isinstance(module, TopKRouter):
                module.weight.add_(torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(6)))
        moved = megatron.forward(policy, input_ids, record_experts=True).experts
    assert not torch.equal(moved.sort(-1).values, recorded.experts.sort(-1).values)

    maps, hooks = _routing_maps(policy)
    replayed = megatron.forward(policy, input_ids, replay_experts=recorded.experts)
    for hook in hooks:
        hook.remove()
    batch, seq = input_ids.shape
    for layer, routing_map in enumerate(maps):  # [seq * batch, experts], sequence-major
        chosen = routing_map.view(seq, batch, -1).transpose(0, 1)
        expected = torch.zeros_like(chosen).scatter_(-1, recorded.experts[:, :, layer], True)
        assert torch.equal(chosen, expected)
    # the gates are the live router's scores at the replayed experts: the router still learns
    megatron.token_logprobs(replayed.logits, input_ids, TEMPERATURE).sum().backward()
    routers = [module for module in policy.modules() if isinstance(module, TopKRouter)]
    assert all(router.weight.grad is not None and router.weight.grad.abs().sum() > 0 for router in routers)
    # and replay is one forward only: the next routes freely again
    with torch.no_grad():
        assert torch.equal(megatron.forward(policy, input_ids, record_experts=True).experts, moved)


@pytest.mark.parametrize("case", MOE_CASES)
def test_replaying_bf16_rollout_experts_brings_fp32_logprobs_closer(hf_models, case):
    """R3 at model level: a bf16 rollout routes some tokens differently from the fp32 trainer; replaying the
    rollout's experts removes that part of train_rollout_logprob_abs_diff (measured here: qwen3_moe
    0.046 -> 0.024, glm4_moe 0.029 -> 0.022)."""
    model, _, _ = hf_models[case]
    policy = _megatron_model(hf_models, case, routing_replay=True)
    rollout = copy.deepcopy(model).to(torch.bfloat16)
    input_ids = torch.randint(0, VOCAB, (8, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        experts = _hf_experts(rollout, input_ids)
        logits = rollout(input_ids=input_ids).logits
        rollout_logprobs = scaled_logprobs(logits[:, :-1], TEMPERATURE).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        free = megatron.forward(policy, input_ids, record_experts=True)
        replayed = megatron.forward(policy, input_ids, replay_experts=experts)
    assert not torch.equal(free.experts.sort(-1).values, experts.sort(-1).values)  # bf16 did route differently
    diff_free = (megatron.token_logprobs(free.logits, input_ids, TEMPERATURE) - rollout_logprobs).abs().mean()
    diff_r3 = (megatron.token_logprobs(replayed.logits, input_ids, TEMPERATURE) - rollout_logprobs).abs().mean()
    assert diff_r3 < 0.9 * diff_free


def test_recomputed_layers_route_the_backward_pass_as_the_replayed_forward(hf_models):
    """With activation recomputation the backward pass runs each layer's forward again: it must send the tokens
    to the replayed experts too, or the gradients are those of other experts. The replay ends at the next
    forward, which then routes freely."""
    model, checkpoint, _ = hf_models["qwen3_moe"]
    input_ids, _ = _right_padded_batch(seed=4)
    experts = torch.rand(*input_ids.shape, 2, 4, generator=torch.Generator().manual_seed(4)).argsort(-1)[..., :2]
    gradients, free = [], []
    for recompute in (False, True):
        policy = _megatron_model(hf_models, "qwen3_moe", routing_replay=True, recompute=recompute).train()
        assert policy.config.recompute_granularity == ("full" if recompute else None)
        megatron.forward(policy, input_ids, replay_experts=experts).logits.logsumexp(-1).sum().backward()
        gradients.append({name: param.grad for name, param in policy.named_parameters()})
        with torch.no_grad():
            free.append(megatron.forward(policy, input_ids).logits)
    plain, recomputed = gradients
    assert plain.keys() == recomputed.keys()
    assert [name for name in plain if not torch.equal(plain[name], recomputed[name])] == []
    assert torch.equal(free[0], free[1])
    routed = megatron.forward(policy, input_ids, record_experts=True).experts
    assert not torch.equal(routed, experts)  # the replayed experts are not the router's own


def test_grouped_experts_run_a_pass_that_brings_them_no_tokens(hf_models):
    """Under expert parallelism a rank can be sent no tokens for a layer (a short micro-batch); its experts
    still take part in the forward and the backward, since the dispatcher's exchanges need every rank, and
    add nothing to their gradients, whatever the layout of the gradient that comes back (grouped_mm's own
    backward fails on an empty one with zero strides, as ``sum`` gives)."""
    config = hf_models["qwen3_moe"][0].config
    experts = _megatron_model(hf_models, "qwen3_moe").decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "GroupedExperts"
    tokens, probs = torch.zeros(0, config.hidden_size, requires_grad=True), torch.zeros(0, requires_grad=True)
    out, _ = experts(tokens, torch.zeros(config.num_experts, dtype=torch.int64), probs)
    out.sum().backward()
    assert out.shape == (0, config.hidden_size) and tokens.grad.shape == (0, config.hidden_size)
    assert probs.grad.shape == (0,)
    assert not experts.linear_fc1.weight.grad.any() and not experts.linear_fc2.weight.grad.any()


def test_recomputing_trainer_takes_the_step_the_plain_one_does(hf_models):
    """``--recompute-activations`` reaches the model, and a step with replayed experts is the same step."""
    model, _, folder = hf_models["qwen3_moe"]
    batch = _batch(seed=2, config=model.config)
    plain, recomputing = (_engine(megatron.MegatronTrainEngine, folder, recompute=recompute)
                          for recompute in (False, True))
    assert recomputing.policy.model.config.recompute_granularity == "full"
    assert plain.train_step(batch) == recomputing.train_step(batch)
    ours = recomputing.named_weights()
    assert [name for name, tensor in plain.named_weights().items() if not torch.equal(tensor, ours[name])] == []


def test_padding_for_sequence_parallelism_gets_distinct_experts(hf_models, monkeypatch):
    """Under sequence parallelism a batch is right-padded to a multiple of the ranks and each rank's routers
    replay their share of the positions: here rank 1 of 2, whose share of 3 positions padded to 4 is position
    2 and the padding. megatron-core's alltoall dispatcher counts exactly top_k experts per token, so the
    padding must name top_k distinct ones, never one expert twice."""
    policy = _megatron_model(hf_models, "qwen3_moe", routing_replay=True)
    config = hf_models["qwen3_moe"][0].config
    monkeypatch.setattr(megatron.routing, "_sequence_ranks", lambda model: (1, 2))
    generator = torch.Generator().manual_seed(0)
    experts = torch.rand(2, 3, config.num_hidden_layers, config.num_experts, generator=generator).argsort(-1)
    experts = experts[..., :config.num_experts_per_tok]
    with megatron.routing._routing(policy, (2, 3), 4, experts, record=False) as handles:
        targets = [handle.target_topk_idx.clone() for handle in handles]
    for layer, target in enumerate(targets):
        assert torch.equal(target[:2], experts[:, 2, layer])  # position 2 of both rows, sequence-major
        assert [len(set(row)) for row in target[2:].tolist()] == [config.num_experts_per_tok] * 2


def test_replay_needs_experts_for_every_token_and_moe_layer(hf_models):
    policy = _megatron_model(hf_models, "qwen3_moe", routing_replay=True)
    input_ids, _ = _right_padded_batch(seed=7)
    with pytest.raises(ValueError, match="moe_layers"):
        megatron.forward(policy, input_ids, replay_experts=torch.zeros(3, 24, 1, 2, dtype=torch.long))
    dense = _megatron_model(hf_models, "qwen3", routing_replay=True)
    with pytest.raises(ValueError, match="routing_replay=True"):
        megatron.forward(dense, input_ids, record_experts=True)


def test_hf_folder_written_from_megatron_loads_in_transformers(hf_models, tmp_path):
    model, _, _ = hf_models["glm4_moe"]
    policy = _megatron_model(hf_models, "glm4_moe")
    megatron.write_hf_folder(tmp_path, model.config, megatron.hf_weights(policy, model.config))
    config, state = megatron.read_hf_folder(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids, _ = _right_padded_batch(seed=8)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=input_ids).logits, model(input_ids=input_ids).logits)
    assert config.model_type == "glm4_moe" and sorted(state) == sorted(hf_models["glm4_moe"][1])
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(64)}, tmp_path / "model-stale.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight is in two safetensors files .* remove the stale one"):
        megatron.read_hf_folder(tmp_path)


def test_unsupported_models_and_layouts_are_refused_with_the_reason():
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        megatron.transformer_config(llama)
    glm = tiny_config("glm4_moe", VOCAB)
    glm.norm_topk_prob = False
    with pytest.raises(ValueError, match="norm_topk_prob"):
        megatron.transformer_config(glm)
    with pytest.raises(ValueError, match="1 processes for --tensor-model-parallel-size 2 x --data-parallel-size 2 x "
                                         "--pipeline-model-parallel-size 2: launch with torchrun --nproc-per-node 8"):
        megatron.build_model(tiny_config("qwen3", VOCAB), tensor_parallel=2, data_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match="pick a --pipeline-model-parallel-size that divides them, not 3"):
        megatron.transformer_config(tiny_config("qwen3", VOCAB), pipeline_parallel=3)
    odd = tiny_config("qwen3_moe", VOCAB)
    odd.moe_intermediate_size = 6
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(6 / 1\) to be whole multiples of 4"):
        megatron.build_model(odd)
    with pytest.raises(ValueError, match="pick a --tensor-model-parallel-size that divides it, not 2"):
        megatron.transformer_config(tiny_config("qwen3", VOCAB - 1), tensor_parallel=2)
    with pytest.raises(ValueError, match="this qwen3 model has none: leave it at 1"):
        megatron.build_model(tiny_config("qwen3", VOCAB), tensor_parallel=2, expert_parallel=2)
    with pytest.raises(ValueError, match=r"--expert-model-parallel-size 2: .* one copy of the trainer "
                                         r"\(--tensor-model-parallel-size 4\) or of all copies \(x "
                                         r"--data-parallel-size 2 = 8\); pass --expert-model-parallel-size 1, 4, 8"):
        megatron.init_parallel(4, 2, 2)


# -- the train engine -------------------------------------------------------------------------------------------


def _engine(cls, folder: Path, updates: int = 2, dtype: str = "fp32", recompute: bool | None = None,
            algo: str = "grpo", max_tokens: int = 0, micro_batch_size: int = 2, **loss):
    """``max_tokens``: micro-batches by that token budget (--use-dynamic-batch-size); else of ``micro_batch_size``
    samples."""
    extra = {} if recompute is None else {"recompute": recompute}
    optim = OptimConfig(lr=1e-3, updates_per_step=updates, micro_batch_size=micro_batch_size,
                        use_dynamic_batch_size=bool(max_tokens), max_tokens_per_gpu=max_tokens)
    return cls(str(folder), algo=algo, optim=optim,
               loss=PolicyLossConfig(**loss), grpo_config=GRPOConfig(), ppo_config=PPOConfig(),
               temperature=TEMPERATURE, total_steps=4, dtype=dtype, **extra)


def _batch(seed: int, config: transformers.PretrainedConfig | None = None, samples: int = 6,
           response_lengths: tuple[int, ...] = (6, 3, 9, 4, 7, 2)) -> TensorBatch:
    """Two groups of three made-up responses of different lengths (the first ``samples`` of them), with rollout
    log-probs near the truth; for an MoE ``config``, random experts (not those its routers would choose) to
    replay at every token fed in."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (length,), generator=generator).tolist() for length in (5, 5, 5, 8, 8, 8)]
    responses = [torch.randint(1, VOCAB, (length,), generator=generator).tolist() for length in response_lengths]
    logprobs = [(-5.0 + torch.randn(len(r), generator=generator)).tolist() for r in responses]
    experts = None
    if config is not None and any(moe_layer_pattern(config)):
        layers, count = sum(moe_layer_pattern(config)), megatron.transformer_config(config).num_moe_experts
        experts = [torch.rand(len(p) + len(r) - 1, layers, count, generator=generator).argsort(-1)
                   [..., :config.num_experts_per_tok].to(torch.int16) for p, r in zip(prompts, responses)]
    return collate(prompts[:samples], responses[:samples], logprobs[:samples],
                   [[0] * len(r) for r in responses[:samples]], rewards=[1.0, 0.0, 0.5, 0.0, 1.0, 1.0][:samples],
                   group_ids=[0, 0, 0, 1, 1, 1][:samples], pad_token_id=0,
                   routed_experts=None if experts is None else experts[:samples])


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe"])
def test_train_step_matches_the_reference_trainer(hf_models, case):
    _, _, folder = hf_models[case]
    reference = _engine(TorchTrainEngine, folder, kl_loss_coef=0.1)
    engine = _engine(megatron.MegatronTrainEngine, folder, kl_loss_coef=0.1)
    for trainer in (reference, engine):
        plain_sgd(trainer)
    initial = {name: tensor.clone() for name, tensor in engine.named_weights().items()}
    batch = _batch(seed=0)
    expected, got = reference.train_step(batch), engine.train_step(batch)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True), key
    assert engine.weight_version == 1
    theirs = reference.policy.state_dict()
    ours = engine.named_weights()
    for name, tensor in ours.items():
        if ".experts." in name:  # transformers keeps experts fused in memory: [experts, 2 * ffn, hidden]
            continue
        assert (tensor - initial[name]).abs().max() > 1e-4, name  # it trained
        assert torch.allclose(tensor, theirs[name], atol=1e-6), name
    fused = theirs["model.layers.1.mlp.experts.gate_up_proj"] if case == "qwen3_moe" else None
    if fused is not None:
        expert = "model.layers.1.mlp.experts.2"
        gate, up = ours[f"{expert}.gate_proj.weight"], ours[f"{expert}.up_proj.weight"]
        assert torch.allclose(torch.cat([gate, up]), fused[2], atol=1e-5)


def test_token_budget_micro_batches_take_the_step_sample_count_ones_do(hf_models):
    """--use-dynamic-batch-size --max-tokens-per-gpu 28 on Megatron: the batch's samples (15, 14, 12, 11, 10 and 8
    tokens) in micro-batches of 1 or 2 (15 alone: 15 + 14 is over 28) take the step that micro-batches of 2
    samples take: the same metrics, the same weights after it."""
    _, _, folder = hf_models["qwen3"]
    batch = _batch(seed=3)
    counted, budgeted = (_engine(megatron.MegatronTrainEngine, folder, max_tokens=tokens) for tokens in (0, 28))
    assert [len(micro.rows) for micro in budgeted._micro_batches(torch.arange(6), SampleSizes.of(batch))] == [
        1, 2, 2, 1]
    _assert_same_step(counted, budgeted, batch)


def _assert_same_step(expected_trainer, trainer, batch: TensorBatch) -> None:
    """Under plain SGD (an update proportional to the gradient), ``trainer`` takes ``expected_trainer``'s step on
    ``batch``: the same metrics, the same weights after it, which moved."""
    for engine in (expected_trainer, trainer):
        plain_sgd(engine)
    initial = {name: tensor.clone() for name, tensor in expected_trainer.named_weights().items()}
    expected, got = expected_trainer.train_step(batch), trainer.train_step(batch)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    ours = trainer.named_weights()
    for name, tensor in expected_trainer.named_weights().items():
        assert (tensor - initial[name]).abs().max() > 1e-4, name  # it trained
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


# responses of very different lengths: samples of 45, 6, 22, 11, 37 and 10 tokens, which a budget of 48 packs as
# [45], [37], [22, 11, 10] and [6] (the scoring pass's micro-batches), where padded micro-batches of 2 samples pad
# each row to the longer one
UNEVEN = (40, 1, 17, 3, 29, 2)
PACKING_BUDGET = 48


@pytest.mark.parametrize("backend", [TorchTrainEngine, megatron.MegatronTrainEngine], ids=["torch", "megatron"])
@pytest.mark.parametrize("case,algo", [("qwen3", "grpo"), ("qwen3_moe", "grpo"), ("qwen3", "ppo")])
def test_packed_rows_train_as_padded_rows_do(hf_models, backend, case, algo):
    """--use-dynamic-batch-size packs each micro-batch's samples into one row without padding: the scored
    log-probs and entropies (and PPO's values), the step's metrics (loss, gradient norm) and the weights after
    a plain-SGD step (the gradient) are those of right-padded micro-batches, on both trainers. The MoE replays
    random experts (R3): each packed token must take its own, or its log-prob moves far over the tolerance; the
    KL reference (GRPO) and the value model (PPO) are packed alike."""
    model, _, folder = hf_models[case]
    batch = _batch(seed=4, config=model.config, response_lengths=UNEVEN)
    loss = {"kl_loss_coef": 0.1} if algo == "grpo" else {}
    padded, packed = (_engine(backend, folder, algo=algo, max_tokens=tokens, **loss) for tokens in (0, PACKING_BUDGET))
    chunks = packed._micro_batches(torch.arange(6), SampleSizes.of(batch))
    assert [len(micro.rows) for micro in chunks] == [1, 1, 3, 1]
    assert packed._inputs(batch.to(packed.device), chunks[2]).input_ids.shape == (1, 43)
    expected, got = padded.score(batch), packed.score(batch)
    assert sorted(got) == sorted(expected)
    for key in expected:
        assert (got[key] - expected[key]).abs().max() <= 1e-5, key
    _assert_same_step(padded, packed, batch)
    if algo == "ppo":  # the value models trained alike
        assert (packed.score(batch)["values"] - padded.score(batch)["values"]).abs().max() <= 1e-5


def _step_reads(engine, batch: TensorBatch) -> collections.Counter:
    """Where one ``train_step`` of ``engine`` on ``batch`` (arriving on the host) would make the host wait for a
    GPU, and how often (:class:`DeviceReads`): its models' parameters and buffers start on the device."""
    models = [*engine._trained_models(), *([engine.reference] if engine.reference is not None else [])]
    with DeviceReads([tensor for model in models for tensor in (*model.parameters(), *model.buffers())]) as reads:
        engine.train_step(batch)
    return reads.counts()


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("algo,settings", [("grpo", {"updates": 1}), ("ppo", {"kl_loss_coef": 0.1})],
                         ids=["grpo-scored-in-training", "ppo-with-reference"])
def test_a_step_reads_the_device_no_more_often_for_more_micro_batches(hf_models, layout, algo, settings):
    """Each micro-batch's layout (padded width, packed length, the samples' bounds for the attention) and the
    rows it indexes come from the host, read once per step: a step of six micro-batches per mini-batch makes
    the host wait for the device exactly where and as often as a step of one does (on a GPU each read would
    stall the host until the queued passes finished). The GRPO step scores in its training passes, PPO's in a
    scoring pass of the policy, its KL reference and its value model. A dense model: in MoE layers megatron-core
    reads the device per micro-batch (``sort_chunks_by_idxs``' ``.tolist()``), which vime does not control."""
    _, _, folder = hf_models["qwen3"]
    batch = _batch(seed=4, response_lengths=UNEVEN)
    splits = ({"micro_batch_size": 6}, {"micro_batch_size": 1}) if layout == "padded" else (
        {"max_tokens": 10_000}, {"max_tokens": 1})
    one, many = (_step_reads(_engine(megatron.MegatronTrainEngine, folder, algo=algo, **settings, **split), batch)
                 for split in splits)
    assert one  # the step's own reads are seen: its samples' sizes, its metrics
    assert many == one, f"one micro-batch per mini-batch: {dict(one)}; one per sample: {dict(many)}"


def _raising_on_sync(method: Callable) -> Callable:
    """``method``, run under torch's CUDA sync debug mode set to raise: any call in it that makes the host wait for
    the GPU (a value read, a blocking copy either way, a size known only on the device) fails it."""
    def checked(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return checked


@pytest.mark.gpu
@pytest.mark.parametrize("layout,dtype", [("padded", "fp32"), ("packed", "fp32"), ("packed", "bf16")])
@pytest.mark.parametrize("algo,settings", [("grpo", {"updates": 1}), ("ppo", {"kl_loss_coef": 0.1})],
                         ids=["grpo-scored-in-training", "ppo-with-reference"])
def test_the_micro_batches_of_a_step_on_cuda_never_wait_for_the_gpu(hf_models, monkeypatch, layout, dtype, algo,
                                                                     settings):
    """On a GPU, a step's micro-batch passes (its scoring pass: the policy's, the KL reference's and the value
    model's; each mini-batch's forward and backward passes, a micro-batch per sample) run under torch's sync
    debug mode set to raise: none of them makes the host wait for the GPU, so the host queues each micro-batch
    while the GPU works on the one before. Packed in bf16, the attention is torch's variable-length flash kernel
    (int32 ``cu_seqlens`` on the device, the longest sample's length from the host), which must run. The first
    step runs without it: megatron-core copies its rotary frequencies to the GPU in its first forward (blocking,
    once). A dense model: in MoE layers megatron-core reads the device per micro-batch
    (``sort_chunks_by_idxs``' ``.tolist()``)."""
    from vime.backends.megatron import modules

    kernel_calls = []
    if dtype == "bf16":
        varlen = modules._varlen_attention()
        if varlen is None:
            pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no causal window: packing uses the mask")
        kernel, takes_groups = varlen
        counted = (lambda *args, **kwargs: kernel_calls.append(1) or kernel(*args, **kwargs), takes_groups)
        monkeypatch.setattr(modules, "_varlen_attention", lambda: counted)
    _, _, folder = hf_models["qwen3"]
    batch = _batch(seed=4, response_lengths=UNEVEN)
    split = {"micro_batch_size": 1} if layout == "padded" else {"max_tokens": 1}
    engine = _engine(megatron.MegatronTrainEngine, folder, algo=algo, dtype=dtype, **settings, **split)
    engine.train_step(batch)
    for name in ("score", "_mini_batch_passes"):
        monkeypatch.setattr(engine, name, _raising_on_sync(getattr(engine, name)))
    metrics = engine.train_step(batch)
    assert engine.weight_version == 2 and math.isfinite(metrics["loss"])
    assert bool(kernel_calls) == (dtype == "bf16")


@pytest.mark.gpu
def test_a_packed_row_is_laid_out_on_the_gpu_from_a_shuffle_on_the_host(hf_models):
    """A micro-batch's rows are cut on the host (a step's shuffle, the scoring pass's range) and sent to the GPU
    (``on_device``), where the batch is: the packed layout indexes the batch by those device rows and lays the
    row out from the host's sizes (host rows indexing the batch once failed on every GPU; CPU tests cannot see
    it)."""
    model, _, _ = hf_models["qwen3"]
    batch = _batch(seed=4, config=model.config, response_lengths=UNEVEN).to("cuda")
    micro = on_device([(torch.tensor([2, 3, 5]), True)], SampleSizes.of(batch), "cuda")[0]
    inputs = packed_inputs(batch, micro)
    assert inputs.input_ids.shape == (1, 43) and inputs.input_ids.device.type == "cuda"


def test_packed_rows_recompute_as_padded_rows_run(hf_models):
    """A recomputing Megatron trainer packs too: each layer's recomputation in the backward pass gets the packed
    row's sample bounds and rotary rows again (from its checkpoint) and replays the same experts, so it takes
    the step of a plain trainer on padded rows."""
    model, _, folder = hf_models["qwen3_moe"]
    batch = _batch(seed=4, config=model.config, response_lengths=UNEVEN)
    padded = _engine(megatron.MegatronTrainEngine, folder, kl_loss_coef=0.1)
    packed = _engine(megatron.MegatronTrainEngine, folder, recompute=True, max_tokens=PACKING_BUDGET, kl_loss_coef=0.1)
    _assert_same_step(padded, packed, batch)


def _packed_row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens of samples of ``lengths`` end to end, ``[1, tokens]``, and their positions (0 at each start)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=generator)
    return input_ids, torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)


def test_a_packed_sample_attends_to_its_own_tokens_only(hf_models):
    """In a packed row of samples A, B and C, changing A's tokens leaves B's and C's logits bit for bit as they
    were, and each sample's logits are those it has in a padded row of its own."""
    policy = _megatron_model(hf_models, "qwen3")
    lengths = [13, 7, 10]
    input_ids, positions = _packed_row(lengths, seed=0)
    changed = input_ids.clone()
    changed[0, :lengths[0]] = (changed[0, :lengths[0]] + 1) % VOCAB
    with torch.no_grad():
        logits, after = (megatron.forward(policy, ids, position_ids=positions, sample_lengths=torch.tensor(lengths))
                         .logits for ids in (input_ids, changed))
        assert not torch.equal(logits[0, :lengths[0]], after[0, :lengths[0]])
        assert torch.equal(logits[0, lengths[0]:], after[0, lengths[0]:])
        for sample, start in zip(input_ids[0].split(lengths), [0, 13, 20]):
            alone = megatron.forward(policy, sample.unsqueeze(0)).logits[0]
            assert (logits[0, start:start + len(sample)] - alone).abs().max() <= 1e-5


def test_sample_lengths_not_on_the_host_are_refused(hf_models):
    """A packed row's sample lengths on a device (``meta`` here, standing in for a GPU) are refused with the way
    out, by the forward and by the copy of a host tensor: reading them would make the host wait for the device in
    every forward, and pinning them for the copy would fail."""
    policy = _megatron_model(hf_models, "qwen3")
    input_ids, positions = _packed_row([13, 7], seed=0)
    on_a_device = torch.tensor([13, 7], device="meta")
    with pytest.raises(ValueError, match=r"on meta; pass them on the host .*SampleSizes\.of\(batch\)"):
        megatron.forward(policy, input_ids, position_ids=positions, sample_lengths=on_a_device)
    with pytest.raises(ValueError, match=r"on meta: take it on the host"):
        host_to_device(on_a_device, "cpu")


def test_positions_restart_in_every_packed_sample(hf_models):
    """A packed row's positions start at 0 in each sample (``packed_inputs``), and the GPTModel's layers get the
    rotary embedding of each token's position in its own sample, not in the row."""
    batch = _batch(seed=0)
    inputs = packed_inputs(batch, on_device([(torch.tensor([4, 1, 2]), True)], SampleSizes.of(batch), "cpu")[0])
    lengths = batch.attention_mask[[4, 1, 2]].sum(-1).tolist()
    assert inputs.position_ids.tolist() == [[position for length in lengths for position in range(length)]]
    policy = _megatron_model(hf_models, "qwen3")
    seen = []
    hook = policy.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["rotary_pos_emb"]), with_kwargs=True)
    with torch.no_grad():
        megatron.forward(policy, inputs.input_ids, position_ids=inputs.position_ids,
                         sample_lengths=inputs.sample_lengths)
    hook.remove()
    table = policy.rotary_pos_emb(max(lengths))  # [positions, 1, 1, dims]
    assert torch.equal(seen[0], table[inputs.position_ids[0]])
    assert not torch.equal(seen[0], policy.rotary_pos_emb(sum(lengths)))  # the row's positions would be these


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe"])
def test_ppo_step_matches_the_reference_trainer(hf_models, case):
    """PPO on Megatron: the value model (the checkpoint's backbone with a zero-initialised head) gives the
    reference trainer's values, the same GAE advantages and clipped value loss follow, and both models train
    in the one step as the reference trainer trains them: two mini-batches, so the second one's values have
    moved from the step's starting ones and the clip is in play. The MoE replays random experts (R3) in the
    policy and the value model alike: a value model routing freely would give other values. Every policy
    weight after the step is the reference trainer's, the experts' too (their updates follow the replayed
    routes)."""
    model, _, folder = hf_models[case]
    batch = _batch(seed=0, config=model.config)
    trainers = reference, engine = [_engine(cls, folder, algo="ppo", kl_coef=0.05)
                                    for cls in (TorchTrainEngine, megatron.MegatronTrainEngine)]
    for trainer in trainers:
        plain_sgd(trainer, lr=0.5)
    with torch.no_grad():  # zero-initialised heads: the step is what moves them
        assert not reference._values(batch, every_sample(batch)).any()
    initial = {name: tensor.clone() for name, tensor in _fused_experts(engine.named_weights()).items()}
    expected, got = reference.train_step(batch), engine.train_step(batch)
    assert sorted(got) == sorted(expected) and expected["value_loss"] > 0 and expected["vf_clipfrac"] > 0
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True), key
    with torch.no_grad():
        theirs, ours = reference._values(batch, every_sample(batch)), engine._values(batch, every_sample(batch))
        assert theirs.abs().max() > 0.05 and (ours - theirs).abs().max() <= 1e-5
        free = dataclasses.replace(batch, routed_experts=None)
        if batch.routed_experts is not None:  # the experts replayed were not those the routers choose
            assert (engine._values(free, every_sample(free)) - ours).abs().max() > 1e-3
    theirs = reference.policy.state_dict()
    ours = _fused_experts(engine.named_weights())
    assert sorted(ours) == sorted(theirs)
    assert [name for name, tensor in ours.items() if not torch.allclose(tensor, theirs[name], atol=1e-6)] == []
    if case == "qwen3_moe":  # the experts' updates are those of the replayed routes, not of free routing
        assert all((ours[name] - initial[name]).abs().max() > 1e-4 for name in ours if ".experts." in name)


def _fused_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's Hugging Face weights with each MoE layer's experts fused as transformers keeps them in
    memory: ``gate_up_proj`` [experts, 2 * ffn, hidden] (gate then up) and ``down_proj`` [experts, hidden, ffn]."""
    import re

    fused, experts = {}, {}
    for name, tensor in weights.items():
        matched = re.fullmatch(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
        if matched is None:
            fused[name] = tensor
        else:
            experts.setdefault(matched[1], {}).setdefault(int(matched[2]), {})[matched[3]] = tensor
    for prefix, layer in experts.items():
        ordered = [layer[index] for index in sorted(layer)]
        fused[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in ordered])
        fused[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in ordered])
    return fused


def test_the_value_model_starts_from_critic_model_path(hf_models):
    """--critic-model-path: the value model's backbone is that folder's (here a tied checkpoint beside an untied
    policy), the policy's is --model-path's, and the head is its own, at zero; a value model that cannot
    replay the policy's experts (another MoE) is refused before the run."""
    from vime.backends import routing_replay

    _, policy_checkpoint, folder = hf_models["qwen3"]
    _, critic_checkpoint, critic_folder = hf_models["qwen3-tied"]
    engine = megatron.MegatronTrainEngine(
        str(folder), algo="ppo", optim=OptimConfig(), loss=PolicyLossConfig(), grpo_config=GRPOConfig(),
        ppo_config=PPOConfig(), temperature=TEMPERATURE, critic_model_path=str(critic_folder))
    embedding = "embedding.word_embeddings.weight"
    assert torch.equal(engine.critic.model.state_dict()[embedding], critic_checkpoint["model.embed_tokens.weight"])
    assert torch.equal(engine.policy.model.state_dict()[embedding], policy_checkpoint["model.embed_tokens.weight"])
    head = engine.critic.model.output_layer
    assert isinstance(head, megatron.ValueHead) and not head.weight.any() and not head.bias.any()
    routing_replay.check_critic_folder(hf_models["qwen3_moe"][2], hf_models["qwen3_moe"][2])
    with pytest.raises(ValueError, match="the value model replays the policy's experts, so --critic-model-path"):
        routing_replay.check_critic_folder(hf_models["qwen3_moe"][2], hf_models["glm4_moe"][2])


@pytest.mark.parametrize("case", MOE_CASES)
def test_replayed_rollout_experts_give_the_reference_trainers_logprobs(hf_models, case):
    """R3 end to end on CPU: experts recorded by the torch rollout engine in bf16, replayed by both trainers
    in fp32 -- the Megatron and the reference trainer then agree to float rounding."""
    _, _, folder = hf_models[case]
    rollout = TorchRolloutEngine(str(folder), dtype="bf16", seed=1, record_experts=True)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=6)
    sequences = [Sequence(i, list(range(1 + i, 6 + 2 * i)), params) for i in range(4)]
    rollout.add(sequences)
    while rollout.busy:
        rollout.step()
    batch = collate([s.prompt_ids for s in sequences], [s.response_ids for s in sequences],
                    [s.logprobs for s in sequences], [s.versions for s in sequences], [1.0, 0.0, 1.0, 0.0],
                    [0, 0, 1, 1], pad_token_id=0, routed_experts=[s.routed_experts for s in sequences])
    reference, engine = _engine(TorchTrainEngine, folder), _engine(megatron.MegatronTrainEngine, folder)
    rows = every_sample(batch)
    free = reference._response_logprobs(reference.policy, dataclasses.replace(batch, routed_experts=None), rows)[0]
    recorded = batch.routed_experts
    moved = torch.where(recorded < 0, recorded, (recorded + 1) % 4)  # other experts than the router's own
    for experts in (recorded, moved):
        replayed = dataclasses.replace(batch, routed_experts=experts)
        expected = reference._response_logprobs(reference.policy, replayed, rows)[0]
        got = engine._response_logprobs(engine.policy, replayed, rows)[0]
        assert (got - expected).abs().max() <= 1e-5
    assert not torch.allclose(free, expected, atol=1e-3)  # the moved experts were really used
    missing = batch.routed_experts.clone()
    missing[1] = -1
    with pytest.raises(ValueError, match="a sample without recorded experts cannot be replayed"):
        engine.train_step(dataclasses.replace(batch, routed_experts=missing))


@pytest.mark.parametrize("case", ["qwen3", *MOE_CASES])
def test_megatron_weights_load_into_the_rollout_engine(hf_models, case):
    """Weight sync from the Megatron trainer: checkpoint names (experts one by one, GLM's expert bias
    buffer) into the torch rollout engine, which holds experts fused; the rollout then computes the
    trainer's log-probs."""
    _, _, folder = hf_models[case]
    engine = _engine(megatron.MegatronTrainEngine, folder)
    engine.train_step(_batch(seed=0))
    rollout = TorchRolloutEngine(str(folder))
    rollout.load_weights(engine.named_weights(), version=1)
    batch = _batch(seed=2)
    rows = every_sample(batch)
    reference = _engine(TorchTrainEngine, folder)
    reference.policy = rollout.model  # score the batch with the rollout engine's model
    expected = engine._response_logprobs(engine.policy, batch, rows)[0]
    assert (reference._response_logprobs(rollout.model, batch, rows)[0] - expected).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="do not fit the model: missing"):
        rollout.load_weights({k: v for k, v in engine.named_weights().items() if "embed" not in k}, version=2)


@pytest.mark.parametrize("algo,dtype", [("grpo", "fp32"), ("grpo", "bf16"), ("ppo", "fp32"), ("ppo", "bf16")])
def test_save_and_load_continue_training_exactly(hf_models, tmp_path, algo, dtype):
    """A checkpoint holds everything the next step depends on: for ppo the value model too (its weights,
    masters and optimizer state), which a trainer built afresh from the model folder would not have."""
    _, _, folder = hf_models["qwen3"]
    engine = _engine(megatron.MegatronTrainEngine, folder, dtype=dtype, algo=algo)
    engine.train_step(_batch(seed=0))
    engine.save(tmp_path)
    resumed = _engine(megatron.MegatronTrainEngine, folder, dtype=dtype, algo=algo)
    resumed.load(tmp_path)
    assert resumed.weight_version == 1
    if algo == "ppo":
        rows = every_sample(_batch(seed=1))
        with torch.no_grad():
            values = engine._values(_batch(seed=1), rows)
            assert values.abs().max() > 0 and torch.equal(resumed._values(_batch(seed=1), rows), values)
    expected, got = engine.train_step(_batch(seed=1)), resumed.train_step(_batch(seed=1))
    assert got == expected
    ours, theirs = engine.named_weights(), resumed.named_weights()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model").config.model_type == "qwen3"
    if dtype == "fp32":  # the same file names, another trainer's optimizer state: refused, not loaded
        _engine(TorchTrainEngine, folder).save(tmp_path / "torch")
        with pytest.raises(ValueError, match=r"written by a trainer of layout \{'train_backend': 'torch'\}, and this "
                                             r"one's is \{'train_backend': 'megatron', 'tensor_parallel': 1"):
            resumed.load(tmp_path / "torch")


def test_a_checkpoint_that_cannot_resume_is_refused_saying_what_to_do(hf_models, tmp_path):
    """What a trainer cannot take from a checkpoint is refused before anything is loaded, saying what to pass:
    another model, another algorithm (a value model or none), a state of another layout from vime before shards
    were recorded, one whose file of a rank is lost, one of two pipeline stages whose second stage's file is lost,
    one of two stages that named the second's layers from 0 (vime before whole-model names), and one of the
    distributed optimizer's in another layout (these made here by editing a one-rank state)."""
    _, _, folder = hf_models["qwen3"]
    saved = _engine(megatron.MegatronTrainEngine, folder, updates=1)
    saved.train_step(_batch(seed=0))  # Adam's moments: what a lost rank's file lacks
    saved.save(tmp_path / "one")
    with pytest.raises(ValueError, match=r"another policy: its output_layer.weight is \[256, 64\] there and absent "
                                         r"here; resume with the --model-path"):
        _engine(megatron.MegatronTrainEngine, hf_models["qwen3-tied"][2]).load(tmp_path / "one")
    with pytest.raises(ValueError, match="with no value model and this one has a value model: resume with the --algo"):
        _engine(megatron.MegatronTrainEngine, folder, algo="ppo").load(tmp_path / "one")
    state = torch.load(tmp_path / "one" / "trainer.pt", weights_only=True)
    state["layout"] = {**state["layout"], "tensor_parallel": 2}
    shape, _ = state["shards"][0]["embedding.word_embeddings.weight"]
    state["shards"][0]["embedding.word_embeddings.weight"] = (shape, (0, 1, 0, 2))
    for name, edit in (("lost", lambda state: state), ("unrecorded", lambda state: {
            key: value for key, value in state.items() if key != "shards"})):
        (tmp_path / name).mkdir()
        torch.save(edit(state), tmp_path / name / "trainer-tp0.pt")
    with pytest.raises(ValueError, match="lacks the trainer state of the rank that held part 1 of 2 of "
                                         "embedding.word_embeddings.weight: the checkpoint is incomplete"):
        saved.load(tmp_path / "lost")
    with pytest.raises(ValueError, match=r"before its checkpoints recorded each rank's shards: resume it with the "
                                         r"layout it was written in, \{'train_backend': 'megatron', "
                                         r"'tensor_parallel': 2"):
        saved.load(tmp_path / "unrecorded")
    whole = torch.load(tmp_path / "one" / "trainer.pt", weights_only=True)
    for name, (first, second) in _stage_files(whole).items():
        (tmp_path / name).mkdir()
        for stage, part in enumerate((first, second)):
            if part is not None:
                torch.save(part, tmp_path / name / f"trainer-tp0-pp{stage}.pt")
    with pytest.raises(ValueError, match=r"lacks the trainer state of the ranks that held decoder\.layers\.1\.\S+: the "
                                         r"checkpoint is incomplete \(a pipeline stage's files are missing\)"):
        saved.load(tmp_path / "stage-lost")
    with pytest.raises(ValueError, match=r"names its parameter decoder\.layers\.0\.\S+ by its pipeline stage's own "
                                         r"layer numbers .* resume it with the layout it was written in"):
        saved.load(tmp_path / "stage-numbered")
    (tmp_path / "sharded").mkdir()
    torch.save({**state, "layout": {**state["layout"], "tensor_parallel": 1, "data_parallel": 2,
                                    "distributed_optimizer": True}}, tmp_path / "sharded" / "trainer-tp0-dp0.pt")
    with pytest.raises(ValueError, match="only without --use-distributed-optimizer on either side .* resume with the "
                                         "saving run's --pipeline-model-parallel-size 1 --tensor-model-parallel-size 1 "
                                         "--data-parallel-size 2 --expert-model-parallel-size 1 "
                                         "--use-distributed-optimizer"):
        saved.load(tmp_path / "sharded")


# -- on the GPU (gpu marker; run with `pytest -m gpu`) ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe"])
def test_train_step_on_cuda_matches_the_reference_trainer_on_cpu(hf_models, case, tmp_path):
    """fp32 on the GPU: the batch is moved to the device and the step agrees with the CPU reference trainer.

    One update: Adam's first update is about lr * sign(g), so where a gradient is within rounding of
    zero the two devices may move a weight by lr in opposite directions, and a second update would
    carry that into its loss."""
    _, _, folder = hf_models[case]
    reference, engine = _engine(TorchTrainEngine, folder, 1), _engine(megatron.MegatronTrainEngine, folder, 1)
    assert next(engine.policy.parameters()).is_cuda
    batch = _batch(seed=0)
    expected, got = reference.train_step(batch), engine.train_step(batch)
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6, nan_ok=True), key
    from safetensors.torch import load_file

    reference.save_hf(tmp_path)  # under checkpoint names: transformers keeps MoE experts fused in memory
    ours, theirs = engine.named_weights(), load_file(tmp_path / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        gap = (ours[name].cpu() - theirs[name]).abs()
        assert gap.max() <= 2.1e-3 and (gap > 1e-5).float().mean() < 1e-3, name


@pytest.mark.gpu
def test_variable_length_attention_on_cuda_keeps_each_token_to_its_sample():
    """On a GPU in bf16 a packed row's attention runs torch's variable-length flash kernel (a causal window; grouped
    key/value heads, passed as such or repeated where the kernel takes none): its output and gradients are those
    of each sample's own causal attention, within bf16's rounding."""
    from vime.backends.megatron.modules import _varlen_attention, document_attention

    if _varlen_attention() is None:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn takes no causal window: packing uses the mask")
    generator = torch.Generator().manual_seed(0)
    lengths = [37, 5, 120, 1, 64]
    tensors = [torch.randn(sum(lengths), heads, 64, generator=generator).cuda().bfloat16().requires_grad_()
               for heads in (8, 2, 2)]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()
    packed = document_attention(*tensors, cu_seqlens, max(lengths))
    packed.float().square().sum().backward()
    grads = [tensor.grad.clone() for tensor in tensors]
    for tensor in tensors:
        tensor.grad = None
    alone = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(tensor[start:start + length].transpose(0, 1) for tensor in tensors), is_causal=True,
        enable_gqa=True).transpose(0, 1) for start, length in zip(cu_seqlens.tolist(), lengths)])
    alone.float().square().sum().backward()
    assert (packed.float() - alone.float()).abs().max() <= 2e-2
    for got, tensor in zip(grads, tensors):
        assert (got.float() - tensor.grad.float()).abs().max() <= 2e-2 * tensor.grad.float().abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe"])
def test_bf16_step_on_cuda_trains_from_fp32_masters(hf_models, case):
    """dtype="bf16": bf16 weights (flash SDPA) that are the fp32 masters rounded, close to an fp32 step."""
    _, _, folder = hf_models[case]
    fp32 = _engine(megatron.MegatronTrainEngine, folder)
    bf16 = _engine(megatron.MegatronTrainEngine, folder, dtype="bf16")
    before = {name: tensor.clone() for name, tensor in bf16.named_weights().items()}
    expected, got = fp32.train_step(_batch(seed=0)), bf16.train_step(_batch(seed=0))
    assert all(param.dtype == torch.bfloat16 for param in bf16.policy.parameters())
    assert all(master.dtype == torch.float32 and master.is_cuda for master in bf16.masters.state_dict())
    assert got["train_rollout_logprob_abs_diff"] == pytest.approx(expected["train_rollout_logprob_abs_diff"], rel=0.05)
    assert got["loss"] == pytest.approx(expected["loss"], rel=0.05, abs=1e-3)
    assert all(not torch.equal(before[name], tensor) for name, tensor in bf16.named_weights().items())


# -- in the pipeline -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo,tensor_parallel,pipeline_parallel", [  # CI time: ppo one rank 70 s; ppo TP2 slow
    ("grpo", 1, 1), ("ppo", 1, 1), pytest.param("ppo", 2, 1, marks=pytest.mark.slow),
    pytest.param("grpo", 1, 2, marks=pytest.mark.slow), pytest.param("ppo", 1, 2, marks=pytest.mark.slow)])
async def test_the_pipeline_trains_with_the_megatron_backend(tmp_path, algo, tensor_parallel, pipeline_parallel):
    """--train-backend megatron: the arithmetic scenario's five actors with megatron-core as the trainer,
    weights synced to the torch rollout engine each step; fp32 both sides, so the log-probs agree. With
    --tensor-model-parallel-size 2 the trainer actor leads a second rank in a process it starts; only PPO
    runs so, as it exercises all GRPO's TP2 does (the policy's split weights, their gradients, their sync)
    and the value model besides. With --pipeline-model-parallel-size 2 the two ranks are the model's two
    stages (the value model's too, for PPO), and the rollout engine gets the weights gathered from both. It
    must learn (issue 30): the reward rises by 0.3 or more in 30 steps, so a broken gradient or weight
    conversion in the Megatron path fails here and not only on a GPU. PPO's value model must learn too: GAE
    over values stuck at 0 is a whitened REINFORCE, which learns this task as well, but its value loss is then
    the zero-value baseline, 0.5 x the mean squared return of the step's rows (the rewards are 0 or 1, so 0.5 x
    the mean reward); a value model that tracks the returns brings it under half that."""
    from vime.metrics import MetricsFollower
    from vime.pipeline import train
    from vime.scenarios import arithmetic

    run_dir = tmp_path / "run"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(
        steps=30, seed=3, algo=algo, train_backend="megatron", tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel))
    summary = await train(config, run_dir, timeout_s=300)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["weight_version"] for row in rows] == list(range(1, 31))
    assert max(row["train_rollout_logprob_abs_diff"] for row in rows) <= 1e-5
    start = sum(row["raw_reward"] for row in rows[:5]) / 5
    end = sum(row["raw_reward"] for row in rows[-5:]) / 5
    assert start < 0.1 and end >= start + 0.3, ([row["raw_reward"] for row in rows], start, end)
    if algo == "ppo":
        value_loss = sum(row["value_loss"] for row in rows[-5:]) / 5
        zero_values = sum(0.5 * row["raw_reward"] for row in rows[-5:]) / 5  # 0.5 x mean(return^2), return 0 or 1
        assert value_loss < 0.5 * zero_values, ([row["value_loss"] for row in rows], zero_values)
    assert summary["groups"]["lost"] == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint").config.model_type == "qwen3"


@pytest.mark.parametrize("tensor_parallel,data_parallel,expert_parallel,distributed_optimizer", [
    (1, 2, 2, False), *(pytest.param(*layout, marks=pytest.mark.slow)  # CI time
                        for layout in ((2, 2, 4, False), (2, 1, 2, False), (2, 2, 2, True)))])
async def test_the_pipeline_trains_an_moe_in_the_8_gpu_layout_in_small(tmp_path, tensor_parallel, data_parallel,
                                                                       expert_parallel, distributed_optimizer):
    """qwen3_30b_a3b_dapo's 8-GPU layouts at toy size: a Qwen3-MoE trained by two data-parallel copies of the
    trainer, the experts divided among all their ranks (slime's layout: copies of one rank here, of two in the
    slow tier), or by one copy of two tensor-parallel ranks that divide them; the ranks recompute their layers,
    replaying the experts the torch rollout engine recorded (R3). The experts travel with each sample through
    the buffer to every rank; a wrong or misplaced one changes the trainer's log-probs, which match the
    rollout's to float rounding (fp32 both sides). Experts lost on the way would not show here (fp32 routes
    alike on both sides): the engine tests show that the trainer replays them. With
    ``--use-distributed-optimizer`` (two copies of two ranks, each copy holding all the experts) each copy
    keeps Adam's state for its part of every tensor, its experts' too."""
    from vime.metrics import MetricsFollower
    from vime.pipeline import train
    from vime.scenarios import arithmetic

    run_dir = tmp_path / "run"
    arithmetic.build_model(tmp_path / "moe", seed=5, hidden_size=64, arch="qwen3_moe")
    config = arithmetic.defaults().replace(
        model_path=str(tmp_path / "moe"), steps=4, seed=5, rollout_batch_size=16, max_new_tokens=3,
        train_backend="megatron", tensor_model_parallel_size=tensor_parallel, data_parallel_size=data_parallel,
        expert_model_parallel_size=expert_parallel, recompute_activations=True, use_rollout_routing_replay=True,
        use_distributed_optimizer=distributed_optimizer)
    summary = await train(config, run_dir, timeout_s=300)
    rows = MetricsFollower(run_dir).new_rows()
    assert [row["weight_version"] for row in rows] == [1, 2, 3, 4]
    assert max(row["train_rollout_logprob_abs_diff"] for row in rows) <= 1e-5
    assert summary["groups"]["lost"] == 0


# -- tensor parallelism (ranks as torchrun starts them, gloo on CPU) -------------------------------------------------


def _train_on_ranks(tmp_path: Path, folder: Path, batch: TensorBatch, tensor_parallel: int, expert_parallel: int,
                    data_parallel: int, recompute: bool) -> dict:
    """What rank 0 of ``megatron_tp_worker.py`` wrote after training GRPO on ``batch`` on ranks, one rank per
    tensor x data parallel copy (gloo)."""
    torch.save(_fields(batch), tmp_path / "batch.pt")
    return _on_ranks(tensor_parallel * data_parallel, tmp_path / "out.pt",
                     [folder, tmp_path / "batch.pt", tmp_path / "out.pt", tensor_parallel, expert_parallel,
                      data_parallel, "recompute" if recompute else "keep"])


def _fields(batch: TensorBatch) -> dict[str, torch.Tensor | None]:
    """``batch`` as a worker reads it back from a file (``TensorBatch(**fields)``)."""
    return {field.name: getattr(batch, field.name) for field in dataclasses.fields(batch)}


def _on_ranks(ranks: int, out: Path, arguments: list[object]) -> dict:
    """What rank 0 of ``megatron_tp_worker.py`` wrote to ``out`` after running with ``arguments`` on ``ranks``
    ranks of one gloo group, as torchrun starts them (forked, :mod:`forked_ranks`)."""
    run_ranks(ranks, arguments, out.with_name(f"{out.name}.logs"))
    return torch.load(out, weights_only=True, map_location="cpu")


@pytest.mark.parametrize("case,tensor_parallel,expert_parallel,data_parallel,recompute", [  # CI time: the default
    ("qwen3", 2, 1, 1, False), ("qwen3_moe", 4, 4, 1, True), ("qwen3_moe", 2, 4, 2, True),  # tier has three
    *(pytest.param(*case, marks=pytest.mark.slow) for case in (
        ("qwen3-tied", 2, 1, 1, False), ("qwen3_moe", 2, 1, 1, False), ("qwen3_moe", 2, 2, 1, False),  # MoE layout
        ("glm4_moe", 2, 1, 1, False), ("glm4_moe", 2, 2, 1, True), ("qwen3", 1, 1, 2, False),
        ("qwen3_moe", 1, 2, 2, False), ("qwen3_moe", 2, 2, 2, False)))])
def test_tensor_parallel_ranks_train_as_one_process_does(hf_models, case, tensor_parallel, expert_parallel,
                                                         data_parallel, recompute, tmp_path):
    """Ranks of one group, each holding its share of every split tensor (q/k/v by key/value group, gate and up,
    every expert's too or, with expert parallelism, some experts whole, the vocabulary) and norming and routing
    its share of the positions (sequence parallelism; an MoE model replays given experts): the gathered weights
    are the checkpoint's bit for bit, and the log-probs, the step's metrics (the gradient norm over all ranks'
    shards among them) and the updated weights (plain SGD, so a gradient clipped otherwise shows) are those of
    one process; a checkpoint of all ranks resumes
    exactly. Four ranks over two key/value heads is the 8-GPU layout of qwen3_30b_a3b_dapo in small (eight
    ranks, four heads): Megatron then gathers q/k/v across the ranks and each keeps its query heads, and the
    alltoall dispatcher moves each token to the rank of its experts. Two data-parallel copies of two ranks,
    the experts divided among all four, is slime's layout for it in small (two copies of four); the copies
    split five samples three and two, so one adds a pass that counts for nothing to take part in the
    other's expert exchanges. Where the ranks recompute their layers, the single process does not: the
    step is the same."""
    model, checkpoint, folder = hf_models[case]
    batch = _batch(seed=0, config=model.config, samples=5 if data_parallel > 1 else 6)
    ranks = _train_on_ranks(tmp_path, folder, batch, tensor_parallel, expert_parallel, data_parallel, recompute)
    assert sorted(ranks["loaded"]) == sorted(checkpoint)
    assert [name for name in checkpoint if not torch.equal(ranks["loaded"][name], checkpoint[name])] == []
    # the order rollout engines get them, bucket by bucket, each once
    assert [name for name, _ in ranks["streamed"]] == list(ranks["loaded"])
    streamed = dict(ranks["streamed"])
    assert all(torch.equal(streamed[name], checkpoint[name].bfloat16()) for name in checkpoint)
    single = _engine(megatron.MegatronTrainEngine, folder, updates=1, kl_loss_coef=0.1)
    plain_sgd(single)  # as the ranks: a step of the gradient's size shows whether the ranks clipped it
    assert (ranks["logprobs"] - single.score(batch)["old_logprobs"].cpu()).abs().max() <= 1e-5
    expected = single.train_step(batch)
    assert expected["grad_norm"] > 1.0  # above --grad-clip's default: the step is clipped
    for key in expected:
        assert ranks["metrics"][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True), key
    for name, tensor in single.named_weights().items():
        assert (ranks["trained"][name] - tensor.cpu()).abs().max() <= 1e-5, name
    assert ranks["resumed_alike"]
    assert all(gap <= 1e-5 for gap in ranks["vocabulary_gaps"]), ranks["vocabulary_gaps"]


@pytest.mark.parametrize("case,layout", [("qwen3", (2, 1, 1, 1)), ("qwen3_moe", (2, 2, 1, 1)),  # CI time: 9-25 s
                                         ("qwen3", (1, 1, 2, 1)), ("qwen3", (1, 1, 1, 2)),  # each
                                         ("qwen3_moe", (1, 1, 1, 2))])
def test_tensor_parallel_ranks_train_packed_rows_as_padded_ones(hf_models, tmp_path, case, layout):
    """Packed micro-batches under tensor (and expert, data or pipeline) parallelism (``layout``: tensor, expert,
    data, pipeline sizes): sequence parallelism cuts a packed row's tokens among the ranks (a row of an odd
    count is padded with a sample of its own), each rank's attention sees the whole row and keeps every token
    to its sample; the scored log-probs and entropies, the step's metrics and the weights after a plain-SGD step
    are those the same ranks give with padded micro-batches. The MoE replays random experts (R3), each rank
    routing its share of the row's tokens; two data-parallel copies each pack their own share of the samples;
    two pipeline stages pass each packed row's activations from one to the other (megatron-core's 1F1B
    schedule), each stage keeping every token to its sample and replaying its own MoE layers' experts."""
    model, _, folder = hf_models[case]
    batch = _batch(seed=4, config=model.config, response_lengths=UNEVEN)
    torch.save(_fields(batch), tmp_path / "batch.pt")
    ranks = _on_ranks(layout[0] * layout[2] * layout[3], tmp_path / "out.pt",
                      ["packed", folder, tmp_path / "batch.pt", tmp_path / "out.pt", *layout, PACKING_BUDGET])
    padded, packed = ranks["padded"], ranks["packed"]
    for key in ("logprobs", "entropy"):
        assert (packed[key] - padded[key]).abs().max() <= 1e-5, key
    assert padded["metrics"]["grad_norm"] > 1.0  # clipped: the norm over every rank's shard decides the step
    for key, value in padded["metrics"].items():
        assert packed["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key
    for name, tensor in padded["weights"].items():
        assert (packed["weights"][name] - tensor).abs().max() <= 1e-5, name


@pytest.mark.parametrize("case,tensor_parallel,expert_parallel,data_parallel,recompute,pipeline_parallel", [
    ("qwen3", 2, 1, 1, False, 1), ("qwen3", 1, 1, 1, False, 2), ("qwen3-tied", 1, 1, 1, False, 2),  # CI time: ~15 s
    *(pytest.param(*layout, marks=pytest.mark.slow) for layout in (
        ("qwen3_moe", 2, 4, 2, True, 1), ("qwen3_moe", 1, 1, 1, False, 2), ("qwen3_moe", 1, 1, 1, True, 2),
        ("qwen3", 2, 1, 1, False, 2)))])
def test_tensor_parallel_ranks_train_ppo_as_one_process_does(hf_models, case, tensor_parallel, expert_parallel,
                                                             data_parallel, recompute, pipeline_parallel, tmp_path):
    """PPO's value model under tensor parallelism: each rank's value head computes the values of its share of
    the positions, gathered whole on every rank, and its gradient is summed over the ranks; the policy's weights
    and the values after a step (the head off zero), the step's metrics (the value model's gradient norm,
    ``value_grad_norm``, among them) and a resumed trainer's next step are those of one process. Plain SGD:
    Adam's step would hide a gradient counted twice. In the MoE layout (two copies of two ranks, the experts
    divided among all four, layers recomputed) the value model replays the batch's experts as the policy does.
    In pipeline stages the value model is split as the policy is, its head on the last stage (a tied policy's
    value model holds no copy of the embedding there: its output layer is the head), and runs through
    megatron-core's schedule apart from the policy: its values to score the batch, then its value loss's
    forward and backward passes; an MoE's stages replay their own layers' experts in it too, recomputing
    layers or not."""
    model, _, folder = hf_models[case]
    batch = _batch(seed=0, config=model.config, samples=5 if data_parallel > 1 else 6)
    torch.save(_fields(batch), tmp_path / "batch.pt")
    ranks = _on_ranks(tensor_parallel * data_parallel * pipeline_parallel, tmp_path / "out.pt",
                      ["ppo", folder, tmp_path / "batch.pt", tmp_path / "out.pt", tensor_parallel, expert_parallel,
                       data_parallel, "recompute" if recompute else "keep", pipeline_parallel])
    single = _engine(megatron.MegatronTrainEngine, folder, algo="ppo")
    plain_sgd(single, lr=0.5)
    expected = single.train_step(batch)
    assert expected["value_grad_norm"] > 0  # the value model's own, summed over the ranks' shares as the policy's
    assert sorted(ranks["metrics"]) == sorted(expected)
    for key in expected:
        assert ranks["metrics"][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True), key
    for name, tensor in single.named_weights().items():
        assert (ranks["trained"][name] - tensor).abs().max() <= 1e-5, name
    values = single.score(batch)["values"]
    assert values.abs().max() > 0.05 and (ranks["values"] - values).abs().max() <= 1e-5
    assert ranks["resumed"] == pytest.approx(ranks["again"], rel=0, abs=0, nan_ok=True)  # exactly


@pytest.mark.parametrize("case,algo,dtype,ranks_layout,ranks_save", [  # CI time: 10-15 s each; six by default
    pytest.param("qwen3", "ppo", "fp32", (2, 1, 1, 1), True, id="ppo-tp2-to-one"),
    pytest.param("qwen3", "grpo", "bf16", (2, 1, 1, 1), True, id="bf16-tp2-to-one"),
    pytest.param("qwen3", "grpo", "fp32", (1, 1, 2, 1), True, id="dp2-to-one", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "grpo", "fp32", (2, 2, 1, 1), True, id="moe-tp2-ep2-to-one", marks=pytest.mark.slow),
    pytest.param("qwen3", "ppo", "fp32", (2, 1, 1, 1), False, id="ppo-one-to-tp2", marks=pytest.mark.slow),
    pytest.param("qwen3", "grpo", "fp32", (1, 1, 1, 2), True, id="pp2-to-one"),
    pytest.param("qwen3_moe", "grpo", "fp32", (1, 1, 1, 2), False, id="moe-one-to-pp2", marks=pytest.mark.slow),
    pytest.param("qwen3-tied", "grpo", "fp32", (1, 1, 1, 2), True, id="tied-pp2-to-one"),
    pytest.param("qwen3-tied", "grpo", "fp32", (1, 1, 1, 2), False, id="tied-one-to-pp2"),
    pytest.param("qwen3-tied", "ppo", "fp32", (1, 1, 1, 2), True, id="ppo-tied-pp2-to-one"),
    pytest.param("qwen3", "ppo", "fp32", (1, 1, 1, 2), False, id="ppo-one-to-pp2", marks=pytest.mark.slow)])
def test_a_checkpoint_resumes_in_another_layout(hf_models, tmp_path, case, algo, dtype, ranks_layout, ranks_save):
    """A checkpoint saved by ranks of one layout (``ranks_layout``: tensor, expert, data parallel, pipeline
    stages) resumes in one process, or one saved by one process resumes on those ranks (``ranks_save`` False):
    the weights it resumes
    from are the saving run's bit for bit, and the step after it is the uninterrupted run's: its metrics, the
    updated weights and, for ppo, the value model's values (its weights and optimizer state resharded with the
    policy's; from pipeline stages and into them too: its head on the last stage only, its weights saved by the
    whole model's names). AdamW, whose second step depends on the first's moments and step count: a resume that dropped
    them would take another step, which the test checks it would notice. In bf16 the masters carry the exact
    weights, and the step after is one of two tensor-parallel ranks in bf16 beside one rank's (issue 34, item
    6): they agree within bf16's rounding (the update within 20 %, where a forgotten optimizer state is over
    100 % off; the loss and gradient norm within 5 %: measured 1 % and 2 %)."""
    model, _, folder = hf_models[case]
    first, second = _batch(seed=0, config=model.config), _batch(seed=1, config=model.config)
    torch.save([_fields(first), _fields(second)], tmp_path / "batches.pt")
    tensor_parallel, _, data_parallel, pipeline_parallel = ranks_layout
    single = _engine(megatron.MegatronTrainEngine, folder, dtype=dtype, algo=algo)
    if not ranks_save:
        single.train_step(first)
        single.save(tmp_path / "checkpoint")
    ranks = _on_ranks(tensor_parallel * data_parallel * pipeline_parallel, tmp_path / "out.pt",
                      ["layouts", folder, tmp_path / "batches.pt", tmp_path / "out.pt", *ranks_layout, algo, dtype,
                       "save" if ranks_save else "resume"])
    if ranks_save:
        single.load(tmp_path / "checkpoint")
    before = {name: tensor.clone() for name, tensor in single.named_weights().items()}
    assert [name for name, tensor in before.items() if not torch.equal(ranks["before"][name], tensor)] == []
    expected = single.train_step(second)
    fp32 = dtype == "fp32"
    for key in expected if fp32 else ("loss", "grad_norm", "entropy"):
        assert ranks["metrics"][key] == pytest.approx(expected[key], rel=1e-4 if fp32 else 5e-2, abs=1e-5,
                                                      nan_ok=True), key
    update_gap = _update_gap(before, single.named_weights(), ranks["weights"])
    assert update_gap <= (1e-4 if fp32 else 0.2)
    assert ranks["tied_alike"]  # a tied embedding's copies in two stages: one tensor in the checkpoint, and after
    if algo == "ppo":
        assert (ranks["values"] - single.score(second)["values"]).abs().max() <= 1e-5
    if ranks_save:
        forgetful = _engine(megatron.MegatronTrainEngine, folder, dtype=dtype, algo=algo)
        forgetful.load(tmp_path / "checkpoint")
        forgetful.optimizer.state.clear()
        forgetful.train_step(second)
        assert _update_gap(before, forgetful.named_weights(), ranks["weights"]) > 0.5


def test_a_checkpoint_of_tensor_parallel_ranks_resumes_in_pipeline_stages(hf_models, tmp_path):
    """Two tensor-parallel ranks save after a step; two pipeline stages, another set of ranks, resume from their
    checkpoint (each stage taking its layers' parts of both ranks' optimizer state and masters, its optimizer's
    groups rebuilt for the parameters it holds) and take the next step as the saving ranks took it: the same
    weights to start from, bit for bit, the same metrics and the same weights after it (AdamW: a stage that
    lost its moments would step elsewhere)."""
    model, _, folder = hf_models["qwen3"]
    torch.save([_fields(_batch(seed=seed, config=model.config)) for seed in (0, 1)], tmp_path / "batches.pt")
    runs = {}
    for name, layout, role in (("saved", (2, 1, 1, 1), "save"), ("resumed", (1, 1, 1, 2), "resume")):
        out = tmp_path / f"{name}.pt"
        runs[name] = _on_ranks(2, out, ["layouts", folder, tmp_path / "batches.pt", out, *layout, "grpo", "fp32",
                                        role])
    saved, resumed = runs["saved"], runs["resumed"]
    assert [name for name, tensor in saved["before"].items() if not torch.equal(resumed["before"][name], tensor)] == []
    for key, value in saved["metrics"].items():
        assert resumed["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), key
    assert _update_gap(saved["before"], saved["weights"], resumed["weights"]) <= 1e-4


@pytest.mark.parametrize("case,algo,dtype,layout", [  # CI time: one by default
    pytest.param("qwen3", "grpo", "fp32", (1, 1, 2, 1), id="dp2"),
    pytest.param("qwen3", "ppo", "fp32", (1, 1, 2, 1), id="ppo-dp2", marks=pytest.mark.slow),
    pytest.param("qwen3", "grpo", "bf16", (1, 1, 2, 1), id="bf16-dp2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "grpo", "fp32", (2, 2, 2, 1), id="moe-tp2-ep2-dp2", marks=pytest.mark.slow),
    pytest.param("qwen3", "grpo", "bf16", (1, 1, 2, 2), id="bf16-dp2-pp2", marks=pytest.mark.slow),
    pytest.param("qwen3-tied", "grpo", "bf16", (1, 1, 2, 2), id="tied-bf16-dp2-pp2", marks=pytest.mark.slow),
    pytest.param("qwen3-tied", "ppo", "bf16", (1, 1, 2, 2), id="ppo-tied-bf16-dp2-pp2", marks=pytest.mark.slow)])
def test_the_distributed_optimizer_trains_as_the_plain_one(hf_models, tmp_path, case, algo, dtype, layout):
    """``distributed_optimizer``: data-parallel ranks each keeping AdamW's state for their part of every tensor
    (the experts' among the ranks holding copies of them, as with two tensor-parallel ranks holding all four
    experts) train as the plain optimizer does over three steps of two updates each: the same metrics (loss,
    gradient norm: clipped alike) and the same weights after, which every rank's parts gathered back make
    whole; a trainer resumed from its checkpoint before the last step takes that step alike; and each rank
    keeps about half the plain optimizer's state. With ppo the value model's group is divided too; in bf16 each
    rank keeps the fp32 masters of its parts only (about half the plain run's), steps them and rounds them into
    its part of the bf16 weights, which the gather makes whole: a gather that left the other ranks' parts
    stale would differ from the plain run's metrics and weights, far over the tolerance. In two pipeline
    stages (bf16, DP2 x PP2), each stage's copies divide that stage's tensors, the value model's too (ppo)."""
    model, _, folder = hf_models[case]
    batches = [_batch(seed=seed, config=model.config) for seed in range(3)]
    torch.save([_fields(batch) for batch in batches], tmp_path / "batches.pt")
    tensor_parallel, expert_parallel, data_parallel, pipeline_parallel = layout
    ranks = _on_ranks(tensor_parallel * data_parallel * pipeline_parallel, tmp_path / "out.pt",
                      ["distributed-optimizer", folder, tmp_path / "batches.pt", tmp_path / "out.pt", tensor_parallel,
                       expert_parallel, data_parallel, algo, dtype, pipeline_parallel])
    plain, distributed, resumed = (ranks["metrics"][name] for name in ("plain", "distributed", "resumed"))
    assert plain[0]["grad_norm"] > 1.0  # above --grad-clip's default: the global norm decides the step
    for expected, got in zip(plain, distributed, strict=True):
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6, nan_ok=True), key
    assert resumed[0] == pytest.approx(distributed[-1], rel=0, abs=0, nan_ok=True)  # exactly
    assert ranks["tied_alike"] == [True] * 3  # a tied embedding's copies, each optimizer's and the resumed one's
    for name, tensor in ranks["weights"]["plain"].items():
        assert (ranks["weights"]["distributed"][name] - tensor).abs().max() <= 1e-6, name
        assert torch.equal(ranks["weights"]["resumed"][name], ranks["weights"]["distributed"][name]), name
    print("optimizer-state and master bytes per rank (plain, distributed):", ranks["state_bytes"],
          ranks["master_bytes"])
    for plain_bytes, distributed_bytes in ranks["state_bytes"] + (ranks["master_bytes"] if dtype == "bf16" else []):
        assert distributed_bytes <= plain_bytes / data_parallel * 1.05


@pytest.mark.parametrize("case,tensor_parallel,pipeline_parallel,data_parallel,expert_parallel,recompute", [
    ("qwen3", 1, 2, 1, 1, False), ("qwen3", 2, 2, 1, 1, False),  # CI time: PP2 ~15 s, TP2 x PP2 ~30 s
    ("qwen3_moe", 1, 2, 1, 1, False), ("qwen3_moe", 1, 2, 1, 1, True),
    ("glm4_moe", 1, 2, 1, 1, False),  # its first layer dense: a stage of dense layers only, under R3, replays nothing
    ("qwen3-tied", 1, 2, 1, 1, False),  # the last stage's output layer a copy of the first's embedding
    *(pytest.param(*layout, marks=pytest.mark.slow) for layout in (
        ("qwen3", 1, 2, 2, 1, False), ("qwen3_moe", 2, 2, 1, 1, False), ("qwen3_moe", 2, 2, 1, 2, False),
        ("qwen3-tied", 2, 2, 1, 1, False), ("qwen3_moe", 2, 2, 1, 2, True)))])
def test_pipeline_stages_train_as_one_process_does(hf_models, tmp_path, case, tensor_parallel, pipeline_parallel,
                                                   data_parallel, expert_parallel, recompute):
    """Pipeline stages on ranks of one group (``pipeline_parallel``, each of ``tensor_parallel`` ranks, in
    ``data_parallel`` copies that split each mini-batch's samples), each holding its
    slice of the layers (the embedding on the first, the final norm and output layer on the last) and running
    megatron-core's 1F1B schedule over micro-batches of unequal widths: the weights gathered from every stage are
    the checkpoint's bit for bit (as loaded, and as streamed to rollout engines), the scores (through the stages,
    the KL reference's too) and, over two steps of two updates each, every step's metrics (loss, gradient norm
    over all stages) and the weights after each step are one process's. Plain SGD, so the weights after a step
    show each gradient (as clipped by the global norm). The Hugging Face folder written from the stages loads as
    one process's weights; a trainer resumed from the per-stage checkpoint takes the last step exactly, and one
    process resumes it too (resharded: the weights the stages held before the last step, and that step). An
    MoE model (one MoE layer per stage)
    replays given experts (R3): each stage its own layers' of the whole model's, in every micro-batch's
    training and scoring passes; with ``expert_parallel`` each stage's ranks divide its experts whole. Where the
    stages recompute their layers (the one process does not), each micro-batch's backward pass replays its own
    experts, though the 1F1B schedule has run the next micro-batch's forward pass in between. A tied
    model's last stage holds a copy of the embedding as its output layer: it stays bit for bit the first
    stage's after every step, and is published, written and resharded as the one tensor."""
    model, checkpoint, folder = hf_models[case]
    batches = [_batch(seed=seed, config=model.config) for seed in range(2)]
    torch.save([_fields(batch) for batch in batches], tmp_path / "batches.pt")
    ranks = _on_ranks(tensor_parallel * pipeline_parallel * data_parallel, tmp_path / "out.pt",
                      ["pipeline", folder, tmp_path / "batches.pt", tmp_path / "out.pt", tensor_parallel,
                       pipeline_parallel, data_parallel, expert_parallel, "recompute" if recompute else "keep"])
    assert sorted(ranks["loaded"]) == sorted(checkpoint)  # every stage's tensors
    assert [name for name in checkpoint if not torch.equal(ranks["loaded"][name], checkpoint[name])] == []
    streamed = dict(ranks["streamed"])
    assert len(streamed) == len(ranks["streamed"])  # each tensor once: a tied embedding too, which two stages hold
    assert all(torch.equal(streamed[name], checkpoint[name].bfloat16()) for name in checkpoint)
    single = _engine(megatron.MegatronTrainEngine, folder, kl_loss_coef=0.1)
    plain_sgd(single)
    expected_scores = single.score(batches[0])
    for key, value in expected_scores.items():
        assert (ranks["scores"][key] - value).abs().max() <= 1e-5, key
    initial = {name: tensor.clone() for name, tensor in single.named_weights().items()}
    for step, batch in enumerate(batches):
        expected = single.train_step(batch)
        assert expected["grad_norm"] > 1.0  # above --grad-clip's default: the global norm decides the step
        assert sorted(ranks["metrics"][step]) == sorted(expected)
        for key in expected:
            assert ranks["metrics"][step][key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5, nan_ok=True), key
        for name, tensor in single.named_weights().items():
            if "e_score_correction_bias" not in name:  # GLM's routing bias is a buffer: no gradient moves it
                assert (tensor - initial[name]).abs().max() > 1e-4, name  # it trained
            assert (ranks["trained"][step][name] - tensor).abs().max() <= 1e-5, (step, name)
    assert ranks["tied_alike"] == [True] * len(batches)  # a tied embedding's copies: equal after every step
    saved = megatron.read_hf_folder(tmp_path / "hf")[1]
    assert sorted(saved) == sorted(checkpoint)
    assert all((saved[name] - tensor).abs().max() <= 1e-5 for name, tensor in single.named_weights().items())
    assert ranks["resumed"] == pytest.approx(ranks["metrics"][-1], rel=0, abs=0, nan_ok=True)  # exactly
    one = _engine(megatron.MegatronTrainEngine, folder, kl_loss_coef=0.1)
    plain_sgd(one)
    one.load(tmp_path / "checkpoint")  # every stage's files, resharded into one process
    assert all(torch.equal(tensor, ranks["trained"][0][name]) for name, tensor in one.named_weights().items())
    last = one.train_step(batches[-1])
    for key, value in ranks["metrics"][-1].items():
        assert last[key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), key


def _stage_files(whole: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any] | None]]:
    """A one-rank trainer state of two layers cut into the files of two pipeline stages, the second holding layer
    1: with the second's file lost (``stage-lost``), and with the second naming its layer 0 in its optimizer's
    parameters, as vime did before it named layers by their place in the whole model (``stage-numbered``)."""
    def part(second: bool, number: Callable[[str], str] = str) -> dict[str, Any]:
        held = {name: record for name, record in whole["shards"][0].items()
                if name.startswith("decoder.layers.1.") == second}
        names = [number(name) for name in whole["parameters"][0] if name in held]
        return {**whole, "layout": {**whole["layout"], "pipeline_parallel": 2}, "shards": [held], "parameters": [names]}

    local = part(True, lambda name: name.replace("decoder.layers.1.", "decoder.layers.0."))
    return {"stage-lost": (part(False), None), "stage-numbered": (part(False), local)}


def _update_gap(before: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                got: dict[str, torch.Tensor]) -> float:
    """How far the update from ``before`` to ``got`` is from the one to ``expected``, relative to the latter
    (norms over every weight together)."""
    def update(after: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(after[name].float() - tensor.float()).flatten() for name, tensor in before.items()])

    return float((update(got) - update(expected)).norm() / update(expected).norm())


def test_the_leader_relays_every_field_of_a_batch_with_routed_experts(hf_models, tmp_path):
    """The follower ranks get the batch the trainer actor trains on, routed experts (int16, a dtype neither
    gloo nor NCCL sends) included, bit for bit. Under torchrun itself, as users launch trainer ranks: the one
    multi-rank test that is (the others fork their ranks, ``forked_ranks``)."""
    import contextlib
    import dataclasses
    import signal
    import subprocess
    import sys

    import psutil

    batch = _batch(seed=0, config=hf_models["qwen3_moe"][0].config)
    sent = {field.name: getattr(batch, field.name) for field in dataclasses.fields(batch)}
    torch.save(sent, tmp_path / "batch.pt")
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                 str(Path(__file__).with_name("megatron_tp_worker.py")), "relay-a-batch",
                                 str(tmp_path / "batch.pt"), str(tmp_path / "received.pt")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = torchrun.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        ranks = psutil.Process(torchrun.pid).children(recursive=True)  # each in a session of its own
        torchrun.send_signal(signal.SIGTERM)  # its agent stops its ranks, then exits
        try:
            _, stderr = torchrun.communicate(timeout=60)
        finally:
            for process in [*ranks, psutil.Process(torchrun.pid)] if torchrun.poll() is None else ranks:
                with contextlib.suppress(psutil.Error):
                    process.kill()
        raise AssertionError(f"torchrun's ranks did not end within 120 s:\n{stderr[-3000:]}") from None
    assert torchrun.returncode == 0, stderr[-3000:]
    received = torch.load(tmp_path / "received.pt", weights_only=True)
    assert sent["routed_experts"].dtype == torch.int16
    assert all(received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
               for name, tensor in sent.items())


def test_a_failed_rank_is_named_and_a_peer_that_never_notices_is_ended_after_the_grace(tmp_path):
    """The tests' launcher of forked ranks fails as torchrun would, only sooner: rank 0 exits with code 3, rank 1
    waits on without end (as a rank waiting on a dead peer may), and the error names both, each with the end of its
    log (what rank 1 printed before it was killed included), ``GRACE_S`` after the failure, not at the timeout."""
    import time

    from forked_ranks import GRACE_S

    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(2, ["stall", "after-rank-0-fails"], tmp_path / "logs", timeout=240)
    took = time.monotonic() - started
    said = str(failed.value)
    assert said.startswith(f"2 of 2 ranks failed: rank 0 exited with code 3, rank 1 was still running "
                           f"{GRACE_S:.0f} s after that (killed)"), said
    assert "rank 1 waits" in said.split("--- the end of rank 1's log:")[1], said
    assert GRACE_S <= took < 60, took


def test_ranks_still_running_at_the_timeout_are_named_and_ended(tmp_path):
    """Ranks that all hang end at the timeout, each named."""
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^2 of 2 ranks failed: rank 0 was still running at the 3 s timeout "
                                             r"\(killed\), rank 1 was still running at the 3 s timeout \(killed\)"):
        run_ranks(2, ["stall", "all"], tmp_path / "logs", timeout=3)
    assert time.monotonic() - started < 60


def test_ranks_of_a_killed_test_process_end_with_it(tmp_path):
    """A pytest worker killed with SIGKILL (CI's watchdog, a user's kill -9) runs no ``finally``: its ranks end
    anyway, with the fork server that made them, instead of waiting on their group for ever."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    logs = tmp_path / "logs"
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from forked_ranks import run_ranks; "
              f"run_ranks(2, ['stall', 'all'], __import__('pathlib').Path({str(logs)!r}), timeout=600)")
    test_process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    ranks: list[int] = []
    try:
        ranks = _waiting_ranks(logs, 2, test_process, deadline=time.monotonic() + 240)
        test_process.kill()  # that process alone: its fork server must notice, and its ranks die with that
        test_process.wait()
        deadline = time.monotonic() + 30
        while any(map(process_running, ranks)):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived their test process by 30 s"
            time.sleep(0.2)
    finally:  # what is left when the test fails: the fork server (in the test process's group), the ranks
        with contextlib.suppress(ProcessLookupError):
            os.killpg(test_process.pid, signal.SIGKILL)
        for pid in filter(process_running, ranks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _waiting_ranks(logs: Path, count: int, test_process, deadline: float) -> list[int]:
    """The process numbers of the ``stall`` ranks once each has said that it waits."""
    import re
    import time

    while True:
        said = [re.search(r"waits as process (\d+)", log.read_text()) if log.exists() else None
                for log in (logs / f"rank{rank}.log" for rank in range(count))]
        if all(said):
            return [int(match.group(1)) for match in said]
        assert test_process.poll() is None, f"the test process exited with {test_process.returncode}"
        assert time.monotonic() < deadline, "the ranks did not start within 240 s"
        time.sleep(0.2)


def test_tensor_parallel_ranks_offer_each_bucket_together_and_stop_together(tmp_path):
    """Rank 0 gets every rank's descriptor of each weight bucket; the others keep pace, bucket by bucket, and
    when rank 0 stops early they stop after the same bucket, so the next publication starts in step. Whether
    to go on reaches them through the group's store (waiting for it runs nothing on a GPU), one message per
    bucket, each deleted once every rank has read it."""
    run_ranks(3, ["share-buckets", tmp_path / "runs"], tmp_path / "logs", timeout=120)
    leader, *followers = (json.loads((tmp_path / f"runs.{rank}").read_text()) for rank in range(3))
    whole = [[[[f"w{i}", [64], "torch.bfloat16"]], [{"rank": rank, "bucket": i} for rank in range(3)]]
             for i in range(3)]
    assert [run["got"] for run in leader["runs"]] == [whole, whole[:1], whole]
    for follower in followers:
        assert [run["got"] for run in follower["runs"]] == [[], [], []]
        assert [run["made"] for run in follower["runs"]] == [[0, 1, 2], [0], [0, 1, 2]]
    assert [rank["messages"] for rank in (leader, *followers)] == [7] * 3 and leader["left"] == []


def test_the_leader_orders_its_followers_to_release_memory_and_stays_in_step(hf_models, tmp_path):
    """Sleep mode beside a tensor-parallel trainer: every rank gives its cached GPU memory back on rank 0's order
    (on CPU there is none to give), and the next order finds them all in step: the gathered weights are the
    checkpoint's."""
    import subprocess
    import sys

    _, checkpoint, folder = hf_models["qwen3"]
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_tp_worker.py")), "lead-and-release",
                           str(folder), str(tmp_path / "weights.pt")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert sorted(weights) == sorted(checkpoint)
    assert all(torch.equal(weights[name], checkpoint[name]) for name in checkpoint)


def test_a_dead_tensor_parallel_rank_stops_the_leader_with_a_clear_error(hf_models):
    """The trainer actor's engine (rank 0) checks its followers before every order: a killed rank is
    reported by number and exit code instead of a collective waiting forever. A call that is still running
    some seconds after a rank died (an NCCL collective waiting on it) ends the leader's process, saying why."""
    import subprocess
    import sys

    _, _, folder = hf_models["qwen3"]
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_tp_worker.py")), "lose-a-follower",
                           str(folder)], capture_output=True, text=True, timeout=300)
    assert "REFUSED trainer rank 1 exited with code -9" in done.stdout, done.stderr[-3000:]
    assert "NOT STOPPED" not in done.stdout and done.returncode == 1, (done.stdout[-3000:], done.stderr[-3000:])
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [(line["event"], line["rank"], line["exit_code"]) for line in logged if line.get("level") == "error"] == [
        ("a trainer rank exited", 1, -9), ("a trainer rank died during a call that waits on it; stopping the trainer",
                                           1, -9)]


def test_a_rank_that_dies_before_joining_stops_the_leader_within_seconds(hf_models):
    """A rank that exits as it starts (out of memory building its model, say, or on a host without the model)
    leaves rank 0 waiting for it in the group's forming; the leader's watch runs from the first start, so the
    trainer's process ends some seconds later naming the rank, not after the group's 30-minute timeout."""
    import subprocess
    import sys
    import time

    _, _, folder = hf_models["qwen3"]
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("megatron_tp_worker.py")),
                           "lose-a-starting-follower", str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "NOT STOPPED" not in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
    assert "trainer rank 1 exited with code 3" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 120

