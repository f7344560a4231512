"""The trainer-memory check of the preflight (issue 36, item 7): a layout whose trainer state cannot fit its GPUs
is refused before any actor starts, naming what to change, and the count behind it is the Megatron model's own."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the count is checked against megatron-core's GPTModel: install.sh dev")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron", "ignore::UserWarning:megatron")

from vime import gpu_memory  # noqa: E402
from vime.backends import megatron  # noqa: E402
from vime.config import RunConfig  # noqa: E402
from vime.devtools.make_tiny_model import full_config, tiny_config  # noqa: E402
from vime.pipeline import preflight  # noqa: E402
from vime.placement import Placement  # noqa: E402
from vime.scenarios import arithmetic  # noqa: E402

GIB = 2**30
TINY = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "glm4_moe": ("glm4_moe", {"attention_bias": True}),
}


def _tiny(case: str):
    arch, changes = TINY[case]
    config = tiny_config(arch, 256)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def _run(**settings) -> RunConfig:
    return RunConfig().replace(train_backend="megatron", dtype="bf16", **settings)


COLOCATED = dict(actor_num_gpus_per_node=1, colocate=True, rollout_backend="vllm")


@pytest.mark.parametrize("case", TINY)
@pytest.mark.parametrize("value_head", [False, True], ids=["policy", "value"])
def test_the_count_is_the_megatron_models_own(case, value_head):
    hf_config = _tiny(case)
    built = sum(param.numel() for param in megatron.build_model(hf_config, value_head=value_head).parameters())
    (dense, experts), = gpu_memory.parameters_per_gpu(hf_config, output_layer=not value_head)
    head = hf_config.hidden_size + 1 if value_head else 0  # the value head's weight and bias, left uncounted
    assert dense + experts + head == built


def test_stages_and_tensor_parallel_ranks_divide_the_count():
    """The split over stages and tensor ranks, against the layout's own arithmetic: megatron-core's stages and
    tensor ranks need several processes (torchrun), so only the one-rank count above is megatron-core's own."""
    hf_config = _tiny("qwen3-tied")
    (whole, _), = gpu_memory.parameters_per_gpu(hf_config)
    embedding = hf_config.vocab_size * hf_config.hidden_size
    stages = gpu_memory.parameters_per_gpu(hf_config, pipeline=2)
    # one layer each; the last stage holds megatron-core's copy of the tied embedding as its output layer
    assert stages[0][0] + stages[1][0] == whole + embedding
    assert stages[0][0] - embedding == stages[1][0] - embedding - hf_config.hidden_size  # the final norm
    (split, _), = gpu_memory.parameters_per_gpu(hf_config, tensor=2)
    norms = hf_config.num_hidden_layers * (2 * hf_config.hidden_size + 2 * hf_config.head_dim) + hf_config.hidden_size
    assert split == (whole - norms) // 2 + norms  # the norms stay whole on every rank
    moe = _tiny("qwen3_moe")
    (_, experts), = gpu_memory.parameters_per_gpu(moe)
    assert gpu_memory.parameters_per_gpu(moe, tensor=2, expert=2)[0][1] == experts // 2


def test_a_4b_trainer_beside_an_awake_engine_is_refused_with_what_to_change():
    shape = full_config("qwen3-4b")
    colocated = _run(**COLOCATED, vllm_args={"gpu_memory_utilization": 0.5})
    placed = Placement("0", ["0"], "")
    counted = gpu_memory.trainer_memory(colocated, shape)
    assert 4.0e9 < counted.parameters < 4.05e9  # Qwen3-4B: 4.02 B parameters, embedding tied
    assert counted.state_bytes == counted.parameters * 18  # bf16: 2 weight + 4 gradient + 12 masters and moments
    with pytest.raises(ValueError) as refused:
        gpu_memory.check_fits(colocated, placed, shape, 80 * GIB)
    said = str(refused.value)
    assert "67.4 GiB" in said and "40.0 GiB" in said and "80.0 GiB" in said
    # the room left, 15.75 % of the card, rounded down: following the advice fits
    assert "--vllm-enable-sleep-mode true" in said and "--vllm-gpu-memory-utilization 0.15 or less" in said
    assert "--expert-model-parallel-size" not in said  # a dense model
    two = _run(**COLOCATED, vllm_args={"gpu_memory_utilization": 0.1})
    with pytest.raises(ValueError, match=r"16.0 GiB that 2 colocated vLLM engine\(s\) keep awake .* "
                                         r"--vllm-gpu-memory-utilization 0.07 or less"):
        gpu_memory.check_fits(two, Placement("0", ["0", "0"], ""), shape, 80 * GIB)  # each takes its share
    asleep = _run(**COLOCATED, vllm_args={"gpu_memory_utilization": 0.5, "enable_sleep_mode": True})
    assert gpu_memory.check_fits(asleep, placed, shape, 80 * GIB).engine_bytes == 0
    # PPO's value model doubles what is trained: no longer fits even asleep
    ppo = _run(**COLOCATED, algo="ppo", vllm_args={"enable_sleep_mode": True})
    with pytest.raises(ValueError, match="a larger --tensor-model-parallel-size") as refused:
        gpu_memory.check_fits(ppo, placed, shape, 80 * GIB)
    assert "sleep-mode" not in str(refused.value)  # asleep already
    with pytest.raises(ValueError, match="or --expert-model-parallel-size"):
        gpu_memory.check_fits(_run(), Placement("0", [], ""), _tiny("qwen3_moe"), 2**16)


def test_the_distributed_optimizer_divides_masters_and_moments_over_the_copies():
    shape = full_config("qwen3-4b", layers=4)
    plain = gpu_memory.trainer_memory(_run(data_parallel_size=4), shape)
    sharded = gpu_memory.trainer_memory(_run(data_parallel_size=4, use_distributed_optimizer=True), shape)
    assert plain.state_bytes == plain.parameters * 18 and sharded.state_bytes == sharded.parameters * (6 + 3)
    # divided as the elements are, not rounded up per parameter: 1.5 bytes of masters and moments at DP8
    eight = gpu_memory.trainer_memory(_run(data_parallel_size=8, use_distributed_optimizer=True), shape)
    assert eight.state_bytes == eight.parameters * 6 + eight.parameters * 12 // 8
    fp32 = gpu_memory.trainer_memory(_run(data_parallel_size=4).replace(dtype="fp32"), shape)
    assert fp32.state_bytes == fp32.parameters * 16


def test_the_preflight_refuses_a_trainer_that_cannot_fit_its_card(tmp_path):
    config = arithmetic.prepare(tmp_path / "run", arithmetic.defaults().replace(
        train_backend="megatron", dtype="bf16", actor_num_gpus_per_node=1))
    with pytest.raises(ValueError, match=r"the trainer cannot fit its GPUs: .* the card has 0.0 GiB"):
        preflight(config, ["0"], card_bytes=2**20)
    preflight(config, ["0"], card_bytes=80 * GIB)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_count_is_most_of_what_a_step_on_cuda_holds_at_its_peak(tmp_path, dtype):
    """On a GPU the count stays below the peak of a real training step (the bound holds), and for a model whose
    state dwarfs its activations (Qwen3-0.6B's width, 4 layers, a 256-token vocabulary, 6 short samples) it is most
    of that peak: what the count leaves out is small."""
    import torch
    import transformers

    from vime.algorithms.grpo import GRPOConfig
    from vime.algorithms.policy_loss import PolicyLossConfig
    from vime.algorithms.ppo import PPOConfig
    from vime.backends.base import collate
    from vime.config import OptimConfig

    shape = full_config("qwen3-0.6b", layers=4, vocab_size=256)
    transformers.AutoModelForCausalLM.from_config(shape).save_pretrained(tmp_path / "model")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (8,), generator=generator).tolist() for _ in range(6)]
    responses = [torch.randint(1, 256, (8,), generator=generator).tolist() for _ in range(6)]
    batch = collate(prompts, responses, [[-5.0] * 8 for _ in responses], [[0] * 8 for _ in responses],
                    rewards=[1.0, 0.0, 0.5, 0.0, 1.0, 1.0], group_ids=[0, 0, 0, 1, 1, 1], pad_token_id=0)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine = megatron.MegatronTrainEngine(str(tmp_path / "model"), algo="grpo", optim=OptimConfig(
        lr=1e-5, updates_per_step=1, micro_batch_size=2), loss=PolicyLossConfig(), grpo_config=GRPOConfig(),
        ppo_config=PPOConfig(), temperature=1.0, total_steps=2, dtype=dtype)
    engine.train_step(batch)
    peak = torch.cuda.max_memory_allocated() - before
    counted = gpu_memory.trainer_memory(_run().replace(dtype=dtype), shape).state_bytes
    assert 0.7 * peak <= counted <= peak, (counted / GIB, peak / GIB)
