"""vime.flops: the matmul parameters a token goes through, counted from the config, against the model's own
parameters; and the attention term, by sequence."""

from __future__ import annotations

import pytest
import torch
import transformers

from vime.devtools.make_tiny_model import full_config, tiny_config
from vime.flops import matmul_parameters, training_flops


def _routed_parameters(model: torch.nn.Module, config) -> float:
    """What a token goes through, read off the parameters: every matrix, the input embedding excepted (a
    lookup; counted as the output projection when tied), a routed expert's share of its fused or per-expert
    tensors times the experts a token is sent to."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", 1)
    total = config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0
    for name, param in model.named_parameters():
        if param.dim() < 2 or "embed_tokens" in name:
            continue
        routed = ".experts." in name and "shared_experts" not in name
        total += param.numel() * config.num_experts_per_tok / experts if routed else param.numel()
    return total


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "glm4_moe"])
def test_matmul_parameters_are_those_a_token_goes_through(arch):
    config = tiny_config(arch, 128, hidden_size=64, layers=3)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert matmul_parameters(config) == _routed_parameters(model, config)


def test_qwen3_30b_a3b_goes_through_about_three_billion_parameters():
    assert 3.0e9 < matmul_parameters(full_config("qwen3-30b-a3b")) < 3.6e9  # "A3B": 3.3 B active, embedding included


def test_attention_grows_with_the_square_of_a_sequence():
    config = tiny_config("qwen3", 128)
    one = training_flops(config, [100])
    assert training_flops(config, [100, 100]) == 2 * one
    per_token = 6 * matmul_parameters(config)
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    assert training_flops(config, [300]) == 300 * per_token + attention * 300**2
