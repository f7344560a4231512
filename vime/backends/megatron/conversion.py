"""From Hugging Face to Megatron: a config of the three families vime trains (``qwen3``, ``qwen3_moe``,
``glm4_moe``) as a megatron-core ``TransformerConfig``, and each Megatron tensor as the Hugging Face
tensors it is made of, with the two ways between them (bit-exact both ways).

The conversions work on whole tensors; cutting them into a rank's shard and gathering them back, and
reading and writing the folders, are in ``weights``. The model built from the config is ``model``'s.

Layout conventions that the conversion relies on:

- Megatron fuses q, k and v into ``linear_qkv`` *grouped by key/value head*:
  for each of the ``num_key_value_heads`` groups, that group's query heads,
  then its key head, then its value head (weights and biases alike).
- ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]`` stacked on the output dim.
- Hugging Face checkpoints store experts one by one
  (``mlp.experts.{e}.gate_proj.weight``), as ``save_pretrained`` writes them
  and vLLM reads them; :class:`~vime.backends.megatron.modules.GroupedExperts`
  stacks them on a new first dim, each expert's ``[gate; up]`` as in a dense
  MLP; GLM's ``e_score_correction_bias`` is Megatron's ``router.expert_bias``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from vime.architecture import expert_tensor_parallel, moe_layer_pattern, routed_experts

FAMILIES = ("qwen3", "qwen3_moe", "glm4_moe")


def _check_family(hf_config: Any) -> None:
    family = hf_config.model_type
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported by the Megatron backend; "
                         f"supported: {', '.join(FAMILIES)}")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r}: the Megatron backend builds SwiGLU MLPs only")
    rope = hf_config.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported; only plain RoPE is")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the Megatron backend")
    if family == "glm4_moe":
        if not hf_config.norm_topk_prob:
            raise ValueError("glm4_moe with norm_topk_prob=False: megatron-core always normalises sigmoid top-k")
        if hf_config.n_group > 1 and hf_config.num_experts_per_tok != 2 * hf_config.topk_group:
            # HF scores a group by its best two experts, Megatron by its best top_k / topk_group
            raise ValueError("glm4_moe group-limited routing maps to Megatron only when "
                             "num_experts_per_tok == 2 * topk_group")


def transformer_config(hf_config: Any, *, params_dtype: torch.dtype = torch.float32, routing_replay: bool = False,
                       tensor_parallel: int = 1, expert_parallel: int = 1, recompute: bool = False,
                       pipeline_parallel: int = 1) -> TransformerConfig:
    """The megatron-core config equivalent to ``hf_config``.

    Routing maps to Megatron as the Hugging Face models compute it: Qwen3-MoE
    takes a softmax over the top-k router logits (the same as softmax-then-
    renormalise when ``norm_topk_prob``), GLM-4.5 a sigmoid, chooses experts
    by score plus ``e_score_correction_bias``, renormalises and scales by
    ``routed_scaling_factor``. The router runs in fp32, as both HF models do.
    No load-balancing loss is added and the expert bias is never updated here:
    the loss is the RL loss alone, as in the reference trainer. ``recompute``
    checkpoints every layer (Megatron's full, uniform recomputation, one
    layer per checkpoint), as slime's recipes for large models do.

    ``pipeline_parallel`` stages hold ``num_hidden_layers / pipeline_parallel`` layers each. Their
    micro-batches are as wide as their longest sample, so the stages exchange each activation's shape before
    it (``variable_seq_lengths``); the loss a micro-batch's last stage returns is already normalised by its
    whole mini-batch (the reference trainer's rule), so megatron-core's schedule must not divide it by the
    micro-batch count again (``calculate_per_token_loss``, with a token count of 1: see
    ``engine.MegatronTrainEngine._pipelined``).
    """
    _check_family(hf_config)
    if hf_config.vocab_size % tensor_parallel:
        raise ValueError(f"the vocabulary ({hf_config.vocab_size} tokens) is divided evenly among the tensor-"
                         f"parallel ranks: pick a --tensor-model-parallel-size that divides it, not {tensor_parallel}")
    if hf_config.num_hidden_layers % pipeline_parallel:
        raise ValueError(f"the model's {hf_config.num_hidden_layers} layers are divided evenly among the pipeline "
                         f"stages: pick a --pipeline-model-parallel-size that divides them, not {pipeline_parallel}")
    family = hf_config.model_type
    settings: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads, kv_channels=hf_config.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=hf_config.attention_bias,
        qk_layernorm=hf_config.use_qk_norm if family == "glm4_moe" else True,
        hidden_dropout=0.0, attention_dropout=hf_config.attention_dropout,
        params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=tensor_parallel, sequence_parallel=tensor_parallel > 1,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel(tensor_parallel, expert_parallel),
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    )
    if pipeline_parallel > 1:
        # megatron-core refuses variable lengths with its default MoE dispatcher, even in a dense model
        settings.update(pipeline_model_parallel_size=pipeline_parallel, pipeline_dtype=params_dtype,
                        variable_seq_lengths=True, calculate_per_token_loss=True,
                        moe_token_dispatcher_type="alltoall")
    if recompute:
        settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    pattern = moe_layer_pattern(hf_config)
    if any(pattern):
        settings.update(
            num_moe_experts=routed_experts(hf_config),
            moe_router_topk=hf_config.num_experts_per_tok, moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_layer_freq=pattern, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_dtype="fp32", moe_grouped_gemm=False, moe_enable_routing_replay=routing_replay,
            moe_token_dispatcher_type="alltoall",
        )
        if family == "qwen3_moe":
            settings.update(moe_router_score_function="softmax", moe_router_pre_softmax=not hf_config.norm_topk_prob)
        else:
            settings.update(
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=hf_config.routed_scaling_factor,
                moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * hf_config.n_shared_experts)
            if hf_config.n_group > 1:
                settings.update(moe_router_num_groups=hf_config.n_group, moe_router_group_topk=hf_config.topk_group)
    return TransformerConfig(**settings)


def _only(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _whole(tensor: torch.Tensor) -> tuple[torch.Tensor]:
    return (tensor,)


@dataclasses.dataclass(frozen=True)
class _TensorMap:
    """One Megatron tensor and the Hugging Face tensors it is made of, with the two ways between them."""

    hf_names: tuple[str, ...]
    megatron_name: str
    fuse: Callable[[list[torch.Tensor]], torch.Tensor] = _only  # one-to-one unless given
    split: Callable[[torch.Tensor], Sequence[torch.Tensor]] = _whole


def _qkv_map(hf_names: tuple[str, ...], megatron_name: str, hf_config: Any) -> _TensorMap:
    """q, k and v interleaved by key/value group, as Megatron's ``linear_qkv`` holds them."""
    groups, head_dim = hf_config.num_key_value_heads, hf_config.head_dim
    per_group = hf_config.num_attention_heads // groups

    def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = parts
        rest = q.shape[1:]
        return torch.cat([q.reshape(groups, per_group, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                          v.reshape(groups, 1, head_dim, *rest)], dim=1).reshape(-1, *rest)

    def split(qkv: torch.Tensor) -> Sequence[torch.Tensor]:
        rest = qkv.shape[1:]
        parts = qkv.reshape(groups, per_group + 2, head_dim, *rest).split([per_group, 1, 1], dim=1)
        return [part.reshape(-1, *rest) for part in parts]

    return _TensorMap(hf_names, megatron_name, fuse, split)


def _experts_maps(hf: str, megatron: str, experts: int) -> list[_TensorMap]:
    """The routed experts, one by one in the checkpoint, stacked in :class:`GroupedExperts`."""
    gate_up = tuple(f"{hf}{expert}.{proj}_proj.weight" for expert in range(experts) for proj in ("gate", "up"))

    def fuse_fc1(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.cat(parts[2 * expert:2 * expert + 2]) for expert in range(experts)])

    def split_fc1(fc1: torch.Tensor) -> list[torch.Tensor]:
        return [half for expert in fc1 for half in expert.chunk(2)]

    return [_TensorMap(gate_up, megatron + "linear_fc1.weight", fuse_fc1, split_fc1),
            _TensorMap(tuple(f"{hf}{expert}.down_proj.weight" for expert in range(experts)),
                       megatron + "linear_fc2.weight", torch.stack, torch.unbind)]


def _tensor_maps(hf_config: Any, lm_head: bool = True) -> list[_TensorMap]:
    """Every tensor of the GPTModel, and where it comes from in a Hugging Face checkpoint; without ``lm_head``
    (a value model, whose head is its own), the checkpoint's output layer is not among them."""
    maps = [_TensorMap(("model.embed_tokens.weight",), "embedding.word_embeddings.weight"),
            _TensorMap(("model.norm.weight",), "decoder.final_layernorm.weight")]
    if lm_head and not hf_config.tie_word_embeddings:
        maps.append(_TensorMap(("lm_head.weight",), "output_layer.weight"))
    experts = routed_experts(hf_config)
    for layer, moe in enumerate(moe_layer_pattern(hf_config)):
        hf, megatron = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        pairs = [("input_layernorm.weight", "input_layernorm.weight"),
                 ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                 ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight")]
        if hf_config.model_type != "glm4_moe" or hf_config.use_qk_norm:
            pairs += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                      ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
        mlps = [("mlp.", "mlp.")]
        if moe:
            pairs.append(("mlp.gate.weight", "mlp.router.weight"))
            mlps = [("mlp.shared_experts.", "mlp.shared_experts.")] if hf_config.model_type == "glm4_moe" else []
            maps += _experts_maps(hf + "mlp.experts.", megatron + "mlp.experts.", experts)
            if hf_config.model_type == "glm4_moe":
                pairs.append(("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias"))
        maps += [_TensorMap((hf + hf_name,), megatron + megatron_name) for hf_name, megatron_name in pairs]
        for kind in ("weight", "bias") if hf_config.attention_bias else ("weight",):
            maps.append(_qkv_map(tuple(f"{hf}self_attn.{proj}_proj.{kind}" for proj in "qkv"),
                                 f"{megatron}self_attention.linear_qkv.{kind}", hf_config))
        for hf_mlp, megatron_mlp in mlps:
            maps += [_TensorMap((f"{hf}{hf_mlp}gate_proj.weight", f"{hf}{hf_mlp}up_proj.weight"),
                                f"{megatron}{megatron_mlp}linear_fc1.weight", torch.cat, lambda fc1: fc1.chunk(2)),
                     _TensorMap((f"{hf}{hf_mlp}down_proj.weight",), f"{megatron}{megatron_mlp}linear_fc2.weight")]
    return maps


def hf_to_megatron(hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """Hugging Face checkpoint tensors (safetensors names) as the GPTModel's state, by Megatron name.

    GLM-4.5 checkpoints carry multi-token-prediction layers after the last
    decoder layer (``model.layers.{num_hidden_layers}...``); like the Hugging
    Face model, the policy has no use for them and they are left out, as is a
    tied model's ``lm_head.weight`` if the checkpoint stores it. Any other
    tensor that has no place in the model is an error.
    """
    return dict(_converted(hf_state, hf_config))


def _converted(hf_state: Mapping[str, torch.Tensor], hf_config: Any, lm_head: bool = True,
               wanted: Container[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`hf_to_megatron` one Megatron tensor at a time, once the names are checked: the checkpoint's
    tensors are read only as they are converted (a lazy ``hf_state`` then never holds the whole model).
    Without ``lm_head`` (a value model) the checkpoint's output layer is left out, never read; with
    ``wanted`` (a pipeline stage's Megatron names), only those tensors are read and converted."""
    _check_family(hf_config)
    maps = _tensor_maps(hf_config, lm_head)
    missing = [name for tensor_map in maps for name in tensor_map.hf_names if name not in hf_state]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors its config.json implies, e.g. {missing[:3]}; "
                         "is it a complete Hugging Face folder of this model?")
    used = {name for tensor_map in maps for name in tensor_map.hf_names}
    extra_layers = f"model.layers.{hf_config.num_hidden_layers}."
    unknown = sorted(name for name in hf_state if name not in used and not name.startswith(extra_layers)
                     and not ((hf_config.tie_word_embeddings or not lm_head) and name == "lm_head.weight"))
    if unknown:
        raise ValueError(f"checkpoint tensors with no place in a {hf_config.model_type} model: {unknown[:5]}")
    for tensor_map in maps:
        if wanted is None or tensor_map.megatron_name in wanted:
            yield tensor_map.megatron_name, tensor_map.fuse([hf_state[name] for name in tensor_map.hf_names])


def _split_to_hf(tensor_map: _TensorMap, tensor: torch.Tensor,
                 device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One Megatron tensor as its Hugging Face tensors, contiguous, on ``device`` (None: where it is)."""
    for name, part in zip(tensor_map.hf_names, tensor_map.split(tensor), strict=True):
        yield name, part.to(device).contiguous()
