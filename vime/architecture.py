"""What a Hugging Face config.json says about a model's shape, read the same way by every part of vime that needs it
(the FLOP count, the Megatron backend's conversion, the check of Megatron's model flags, ``vime.megatron_flags``,
the value model's check for routing replay),
and how the Megatron layout shares the experts. Imports no torch: the flags are checked before any engine loads."""

from __future__ import annotations

from typing import Any


def moe_layer_pattern(hf_config: Any) -> list[int]:
    """1 for each decoder layer that is a mixture of experts, 0 for a dense one, in order."""
    layers = hf_config.num_hidden_layers
    if hf_config.model_type == "qwen3_moe":
        return [int(layer not in hf_config.mlp_only_layers and hf_config.num_experts > 0
                    and (layer + 1) % hf_config.decoder_sparse_step == 0) for layer in range(layers)]
    if hf_config.model_type == "glm4_moe":
        return [int(layer >= hf_config.first_k_dense_replace) for layer in range(layers)]
    return [0] * layers


def routed_experts(hf_config: Any) -> int:
    """How many routed experts each MoE layer has (Qwen3-MoE's ``num_experts``, GLM-4.5's ``n_routed_experts``); 0
    for a dense model."""
    if hf_config.model_type == "qwen3_moe":
        return hf_config.num_experts
    return getattr(hf_config, "n_routed_experts", None) or 0


def head_dim(hf_config: Any) -> int:
    """Each attention head's width: config.json's head_dim, else the hidden size over the heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def expert_tensor_parallel(tensor_parallel: int, expert_parallel: int) -> int:
    """How many ranks share each expert in vime's Megatron layout: all of a copy's tensor-parallel ranks when the
    experts are not divided whole (expert parallel 1), else one."""
    return tensor_parallel if expert_parallel == 1 else 1
