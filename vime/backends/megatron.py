"""The policy as a megatron-core GPTModel, built from a Hugging Face config.

What is here: the mapping from a Hugging Face config of the three families
vime trains (``qwen3``, ``qwen3_moe``, ``glm4_moe``) to a megatron-core
``TransformerConfig`` and layer spec; the conversion of Hugging Face
safetensors weights to Megatron's layout and back (bit-exact both ways); a
core attention on ``torch.nn.functional.scaled_dot_product_attention``, the
one attention path on CPU and GPU (no Transformer Engine); an MoE layer's
routed experts as two stacked weights in grouped matmuls
(:class:`GroupedExperts`, in place of megatron-core's one-by-one
``SequentialMLP``; ``bench/experts.py``); per-token
log-probs under the sampling temperature, computed exactly as the rollout
reports them (``vime.backends.hf.scaled_logprobs``); R3 -- recording the
experts each token is routed to, and replaying given experts, through
megatron-core's ``RouterReplay``, with the gate weights still differentiable;
and ``MegatronTrainEngine``, the reference trainer's step on this model.

On the GPU the model lives on the current CUDA device and batches are moved
there. ``dtype="bf16"`` makes its parameters bf16 (SDPA then dispatches to
its flash kernel) with fp32 masters for the optimizer
(``vime.backends.master_weights``). Speed figures are measured by
``bench/train.py``.

Tensor parallelism: under ``torchrun`` each rank holds its shard of every
split tensor, cut from the whole checkpoint on load and gathered back for
weight sync and ``save_hf`` (``_shard``/``_unshard``; the conversions
themselves work on whole tensors). It always comes with sequence
parallelism, which megatron-core requires of MoE layers under tensor
parallelism: each rank norms, routes and holds activations for its slice of
the sequence, so a batch is right-padded to a multiple of the ranks. Data
parallelism runs copies of that group, each training its share of a
batch's samples, gradients summed over the copies. An MoE model's experts
are split like its dense MLPs (expert tensor parallelism equal to the
tensor-parallel size) or, with expert parallelism over a copy's ranks or
all copies' ranks, divided among them whole; each split tensor is cut and
gathered over the group that divides it. Activation recomputation
(``recompute``) checkpoints every layer; a replay of the rollout's experts
then holds until the backward pass has run the layers again. What is
deliberately not here yet: pipeline parallelism, Megatron's distributed
optimizer, sequence packing, and PPO's value model.

Layout conventions that the conversion relies on:

- Megatron fuses q, k and v into ``linear_qkv`` *grouped by key/value head*:
  for each of the ``num_key_value_heads`` groups, that group's query heads,
  then its key head, then its value head (weights and biases alike).
- ``linear_fc1`` of a SwiGLU MLP is ``[gate; up]`` stacked on the output dim.
- Hugging Face checkpoints store experts one by one
  (``mlp.experts.{e}.gate_proj.weight``), as ``save_pretrained`` writes them
  and vLLM reads them; :class:`GroupedExperts` stacks them on a new first
  dim, each expert's ``[gate; up]`` as in a dense MLP; GLM's ``e_score_correction_bias`` is Megatron's
  ``router.expert_bias``.
- The rotary embedding uses positions ``0..seq-1`` of each row, so batches
  are right-padded (as ``vime.backends.base.collate`` pads them): padding
  then sits after every real token and, under causal attention, cannot change
  a real token's output.

On CPU (tests only) ``vime.backends.cpu_compat`` patches the CUDA calls
megatron-core cannot do without; MoE layers use the ``alltoall`` token
dispatcher there too, over gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_config import TransformerConfig

from vime.algorithms import grpo, ppo
from vime.algorithms.policy_loss import PolicyLossConfig
from vime.backends import cpu_compat
from vime.backends.base import TensorBatch
from vime.backends.hf import check_model_folder, scaled_logprobs
from vime.backends.routing_replay import MODEL_TYPES as MOE_MODEL_TYPES
from vime.backends.torch_train import TorchTrainEngine
from vime.config import OptimConfig, check_expert_parallel
from vime.flops import moe_layer_pattern

FAMILIES = ("qwen3", "qwen3_moe", "glm4_moe")


def init_parallel(tensor_parallel: int = 1, expert_parallel: int = 1, data_parallel: int = 1) -> None:
    """Set up torch.distributed and megatron-core's process groups, once per process.

    Megatron's layers look up their tensor/pipeline/expert groups globally, so
    even a single-process model needs them. Under ``torchrun`` the world is the
    launcher's (NCCL on GPUs, one per local rank; gloo on CPU): ``data_parallel``
    copies of a tensor-parallel group, consecutive ranks in a copy; with no
    launcher around, it is a world of one over an in-memory store (no port).
    ``expert_parallel`` divides the routed experts among the ranks of a copy
    (``tensor_parallel``) or of all copies (``tensor_parallel x data_parallel``),
    each holding its experts whole; at 1 each rank holds a share of every
    expert. Without CUDA (tests), megatron-core is first patched to place
    tensors on the CPU.
    """
    check_expert_parallel(tensor_parallel, data_parallel, expert_parallel)
    ranks = tensor_parallel * data_parallel
    cpu_compat.apply()
    launched = "LOCAL_RANK" in os.environ
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) if launched else torch.cuda.current_device())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if launched:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != ranks:
        raise ValueError(f"{dist.get_world_size()} processes for --tensor-model-parallel-size {tensor_parallel} x "
                         f"--data-parallel-size {data_parallel}: launch with torchrun --nproc-per-node {ranks} "
                         "(pipeline parallelism is not supported yet)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=expert_parallel,
                                                 expert_tensor_parallel_size=_expert_tensor_parallel(
                                                     tensor_parallel, expert_parallel))
        if torch.cuda.is_available():
            # Megatron forks the CUDA RNG tracker's state around dropout, and under sequence parallelism around
            # every layer, dropout or not: it must be seeded
            model_parallel_cuda_manual_seed(0)
    elif (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_expert_model_parallel_world_size(),
          parallel_state.get_data_parallel_world_size()) != (tensor_parallel, expert_parallel, data_parallel):
        raise ValueError("this process already holds a model of another tensor-, expert- or data-parallel size")


def _expert_tensor_parallel(tensor_parallel: int, expert_parallel: int) -> int:
    """How many ranks share each expert: all of a copy's when the experts are not divided whole, else one."""
    return tensor_parallel if expert_parallel == 1 else 1


class SDPAttention(MegatronModule):
    """Megatron core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Megatron's local ``DotProductAttention`` materialises the ``[b, heads, s, s]``
    score matrix; SDPA picks a fused kernel instead (flash attention on the
    GPU, a blocked kernel on CPU) and handles grouped-query attention without
    repeating the key/value heads. It replaces the local core attention on CPU
    and GPU alike, so tests and training run the same code.

    Only causal self-attention over unpacked sequences is supported: that is
    all a decoder-only policy needs when batches are right-padded.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal or config.context_parallel_size != 1:
            raise NotImplementedError("SDPAttention covers causal self-attention without context parallelism")
        self.softmax_scale = softmax_scale  # None: SDPA's 1/sqrt(head_dim), as in every supported family
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``query [s, b, heads, d]``, ``key``/``value [s, b, groups, d]`` -> ``[s, b, heads * d]``."""
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPAttention takes neither masks, biases nor packed sequences: "
                                      "right-pad the batch and rely on the causal mask")
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        context = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, enable_gqa=query.shape[1] != key.shape[1])
        seq, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm in place of megatron-core's ``WrappedTorchNorm``, allowed under sequence parallelism.

    megatron-core refuses sequence parallelism with its torch norms (it expects
    Transformer Engine's), but a norm acts on each token alone, so it gives
    the same result on a rank's slice of the sequence. Its weight's gradient
    is then each rank's part of the whole; the ``sequence_parallel`` mark, as
    megatron-core sets it on its own norms and routers, tells the trainer to
    sum it over the ranks.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class _Weight(torch.nn.Module):
    """A module holding one expert weight, so that it is named ``<module>.weight`` like a linear layer's; the
    parameter is split on ``partition_dim`` into ``partition_parts`` parts, each cut evenly (see
    :func:`_split_rule`), among the expert-parallel ranks (``whole``: each holds some experts) or the ranks
    that share every expert."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, partition_dim: int, partition_parts: int,
                 whole: bool) -> None:
        super().__init__()
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim, self.weight.partition_parts = partition_dim, partition_parts
        self.weight.expert_split = "model" if whole else "tensor"


class GroupedExperts(MegatronModule):
    """An MoE layer's routed experts as two stacked weights, computed in two grouped matmuls.

    The experts megatron-core offers without Transformer Engine (``SequentialMLP``) run one small MLP per
    expert: with 128 experts, hundreds of small kernels per layer and the GPU mostly idle
    (``bench/RESULTS.md``). Here ``linear_fc1.weight [experts, 2 * ffn, hidden]`` (each expert's ``[gate;
    up]``, as in a dense MLP) and ``linear_fc2.weight [experts, hidden, ffn]`` go through
    ``torch.nn.functional.grouped_mm``: two kernels per layer. The arithmetic is megatron-core's MLP's
    (vime's configs: SwiGLU without biases), then the router's probability, then fc2.
    Under tensor parallelism each rank holds either its experts whole (expert parallelism: the weights
    split on the first dim) or every expert's share of ``ffn``, fc1 split on its rows and fc2 on its
    columns, as in a dense MLP; the token dispatcher moves the tokens, as for SequentialMLP.
    """

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection: Any,
                 name: str | None = None) -> None:
        """As megatron-core's MoE layer builds its experts (``name`` is not used)."""
        super().__init__(config=config)
        shares = pg_collection.expt_tp.size()
        ffn, whole = config.moe_ffn_hidden_size // shares, pg_collection.ep.size() > 1
        align = 16 // config.params_dtype.itemsize  # grouped_mm wants rows of whole 16-byte units
        if ffn * shares != config.moe_ffn_hidden_size or ffn % align or config.hidden_size % align:
            raise ValueError(f"grouped experts need the hidden size ({config.hidden_size}) and each rank's share of "
                             f"moe_intermediate_size ({config.moe_ffn_hidden_size} / {shares}) to be whole multiples "
                             f"of {align} in {config.params_dtype}: change the model's sizes or the tensor-parallel "
                             "size, or use expert parallelism")
        self.linear_fc1 = _Weight((num_local_experts, 2 * ffn, config.hidden_size), config.params_dtype,
                                  *((0, 1) if whole else (1, 2)), whole)
        self.linear_fc2 = _Weight((num_local_experts, config.hidden_size, ffn), config.params_dtype,
                                  *((0, 1) if whole else (2, 1)), whole)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """``tokens [routed, hidden]`` sorted by expert, ``tokens_per_expert [experts]``, ``probs [routed]``.

        A rank can get no tokens at all (expert parallelism, a short micro-batch), and grouped_mm's backward
        fails without rows when the output's gradient has zero strides, as ``sum``'s backward makes it (torch
        2.11 on CUDA, 2.13 on CPU): a zero row is then given to the last expert, which adds nothing to its
        gradient, and dropped from the output. The empty input stays in the graph, so that the gradient still
        flows back through the dispatcher's exchange, which every rank must join."""
        # the dispatchers hand the counts over on the host, once they have synchronised for them
        routed = tokens.shape[0]
        if not routed:
            tokens = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
            probs = torch.cat([probs, probs.new_zeros(1)])
            tokens_per_expert = tokens_per_expert.clone()
            tokens_per_expert[-1] = 1
        ends = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32).to(tokens.device, non_blocking=True)
        gate, up = F.grouped_mm(tokens, self.linear_fc1.weight.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
        return F.grouped_mm(hidden, self.linear_fc2.weight.transpose(1, 2), offs=ends)[:routed], None


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
                       tensor_parallel: int = 1, expert_parallel: int = 1,
                       recompute: bool = False) -> TransformerConfig:
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
    """
    _check_family(hf_config)
    if hf_config.vocab_size % tensor_parallel:
        raise ValueError(f"the vocabulary ({hf_config.vocab_size} tokens) is divided evenly among the tensor-"
                         f"parallel ranks: pick a --tensor-model-parallel-size that divides it, not {tensor_parallel}")
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
        expert_tensor_parallel_size=_expert_tensor_parallel(tensor_parallel, expert_parallel),
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
    )
    if recompute:
        settings.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    pattern = moe_layer_pattern(hf_config)
    if any(pattern):
        settings.update(
            num_moe_experts=hf_config.num_experts if family == "qwen3_moe" else hf_config.n_routed_experts,
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


def build_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32, routing_replay: bool = False,
                tensor_parallel: int = 1, expert_parallel: int = 1, data_parallel: int = 1,
                recompute: bool = False) -> GPTModel:
    """An uninitialised GPTModel of ``hf_config``'s shape: load weights with :func:`load_hf_weights`.

    ``routing_replay`` gives every MoE router a ``RouterReplay`` handle, for
    :func:`forward` to record or replay experts. With ``tensor_parallel`` > 1
    this process holds its rank's shard, and its logits cover its share of
    the vocabulary (:func:`forward` gathers them); ``expert_parallel`` and
    ``data_parallel`` (see :func:`init_parallel`) decide how an MoE model's
    experts are shared; ``recompute``: see :func:`transformer_config`.
    """
    if expert_parallel > 1 and not any(moe_layer_pattern(hf_config)):
        raise ValueError(f"--expert-model-parallel-size divides an MoE model's experts; this "
                         f"{hf_config.model_type} model has none: leave it at 1")
    init_parallel(tensor_parallel, expert_parallel, data_parallel)
    config = transformer_config(hf_config, params_dtype=params_dtype, routing_replay=routing_replay,
                                tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, recompute=recompute)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    block.layer_norm = SequenceParallelRMSNorm
    replaced = 0
    for layer_spec in block.layer_specs:
        layers = layer_spec.submodules
        layers.input_layernorm = layers.pre_mlp_layernorm = SequenceParallelRMSNorm
        attention = layers.self_attention.submodules
        attention.core_attention = SDPAttention
        if config.qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
        mlp = getattr(layers.mlp, "keywords", {}).get("submodules")
        if isinstance(mlp, MoESubmodules):
            mlp.experts = GroupedExperts
            replaced += 1
    if replaced != sum(moe_layer_pattern(hf_config)):
        raise RuntimeError("megatron-core's MoE layer specs are not shaped as in 0.19.2: vime cannot give them "
                           "its GroupedExperts; install megatron-core 0.19.2")
    rope = hf_config.rope_parameters
    model = GPTModel(
        config=config, transformer_layer_spec=block, vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
        rotary_percent=rope.get("partial_rotary_factor", 1.0), rotary_base=rope["rope_theta"],
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings, parallel_output=True)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


# --- weights -------------------------------------------------------------------------------------------------


def _sum_over(tensors: list[torch.Tensor], group: dist.ProcessGroup, bucket_bytes: int = 256 << 20) -> None:
    """Sum ``tensors`` in place over ``group``'s ranks, a few collectives of up to ``bucket_bytes`` each (one
    per tensor would be thousands; one for all would double the gradients' memory)."""
    if dist.get_world_size(group) == 1:
        return
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        if not buckets or size >= bucket_bytes or buckets[-1][0].dtype != tensor.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel() * tensor.element_size()
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(bucket, _unflatten_dense_tensors(flat, bucket))


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


def _tensor_maps(hf_config: Any) -> list[_TensorMap]:
    """Every tensor of the GPTModel, and where it comes from in a Hugging Face checkpoint."""
    maps = [_TensorMap(("model.embed_tokens.weight",), "embedding.word_embeddings.weight"),
            _TensorMap(("model.norm.weight",), "decoder.final_layernorm.weight")]
    if not hf_config.tie_word_embeddings:
        maps.append(_TensorMap(("lm_head.weight",), "output_layer.weight"))
    experts = hf_config.num_experts if hf_config.model_type == "qwen3_moe" else getattr(hf_config, "n_routed_experts", 0)
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


def _converted(hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`hf_to_megatron` one Megatron tensor at a time, once the names are checked: the checkpoint's
    tensors are read only as they are converted (a lazy ``hf_state`` then never holds the whole model)."""
    _check_family(hf_config)
    maps = _tensor_maps(hf_config)
    missing = [name for tensor_map in maps for name in tensor_map.hf_names if name not in hf_state]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors its config.json implies, e.g. {missing[:3]}; "
                         "is it a complete Hugging Face folder of this model?")
    used = {name for tensor_map in maps for name in tensor_map.hf_names}
    extra_layers = f"model.layers.{hf_config.num_hidden_layers}."
    unknown = sorted(name for name in hf_state if name not in used and not name.startswith(extra_layers)
                     and not (hf_config.tie_word_embeddings and name == "lm_head.weight"))
    if unknown:
        raise ValueError(f"checkpoint tensors with no place in a {hf_config.model_type} model: {unknown[:5]}")
    for tensor_map in maps:
        yield tensor_map.megatron_name, tensor_map.fuse([hf_state[name] for name in tensor_map.hf_names])


def megatron_to_hf(megatron_state: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron`: Hugging Face checkpoint names and layouts, contiguous tensors.

    This is what ``save_pretrained`` writes and vLLM loads. A tied model gives
    ``model.embed_tokens.weight`` only, as Hugging Face saves it.
    """
    state = dict(megatron_state)
    out: dict[str, torch.Tensor] = {}
    for tensor_map in _tensor_maps(hf_config):
        out.update(_split_to_hf(tensor_map, state.pop(tensor_map.megatron_name)))
    if state:
        raise ValueError(f"Megatron tensors with no Hugging Face counterpart: {sorted(state)[:5]}")
    return out


def _split_to_hf(tensor_map: _TensorMap, tensor: torch.Tensor,
                 device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One Megatron tensor as its Hugging Face tensors, contiguous, on ``device`` (None: where it is)."""
    for name, part in zip(tensor_map.hf_names, tensor_map.split(tensor), strict=True):
        yield name, part.to(device).contiguous()


def model_tensors(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's live parameters and persistent buffers by name (no copies; ``_extra_state`` left out)."""
    return {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()
            if isinstance(tensor, torch.Tensor)}


def _split_rule(name: str, live: torch.Tensor) -> tuple[int, int, dist.ProcessGroup] | None:
    """How a whole tensor divides among ranks: ``(dim, parts, group)``, or None when every rank holds it whole.
    A gated ``linear_fc1`` is ``[gate; up]``, and each rank holds ``[its gate; its up]``;
    :class:`GroupedExperts`' weights say their own rule and are split among the expert ranks."""
    if not getattr(live, "tensor_model_parallel", False):
        return None
    parts = getattr(live, "partition_parts", 2 if name.endswith("linear_fc1.weight") else 1)
    return live.partition_dim, parts, _split_group(live)


def _split_group(live: torch.Tensor) -> dist.ProcessGroup:
    """The ranks among which a split tensor is divided, in the order of its parts."""
    split = getattr(live, "expert_split", None)
    if split == "model":
        return parallel_state.get_expert_model_parallel_group()
    if split == "tensor":
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def _shard(name: str, whole: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (the model's own layout of the tensor ``live`` holds)."""
    rule = _split_rule(name, live)
    if rule is None:
        return whole
    dim, parts, group = rule
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return torch.cat([part.chunk(size, dim)[rank] for part in whole.chunk(parts, dim)], dim)


def _unshard(name: str, live: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from the ranks that share it (a collective: every rank calls it)."""
    rule = _split_rule(name, live)
    if rule is None:
        return live
    dim, parts, group = rule
    size = dist.get_world_size(group)
    if size == 1:
        return live
    pieces = [torch.empty_like(live) for _ in range(size)]
    dist.all_gather(pieces, live.detach().contiguous(), group=group)
    per_rank = [piece.chunk(parts, dim) for piece in pieces]  # each rank's [its gate; its up], or its one part
    return torch.cat([chunks[part] for part in range(parts) for chunks in per_rank], dim)


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Copy Hugging Face checkpoint tensors into ``model`` in place (optimizers holding its parameters stay valid);
    under tensor parallelism each rank takes its shard of the whole checkpoint, one tensor at a time."""
    live = model_tensors(model)
    names = {tensor_map.megatron_name for tensor_map in _tensor_maps(hf_config)}
    if names != set(live):
        raise ValueError(f"converted weights do not fit the model: missing {sorted(set(live) - names)[:5]},"
                         f" unknown {sorted(names - set(live))[:5]}")
    for name, tensor in _converted(hf_state, hf_config):
        live[name].copy_(_shard(name, tensor, live[name]))


def hf_weights(model: GPTModel, hf_config: Any, device: str | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face checkpoint names: :func:`hf_tensors`, all of them."""
    return dict(hf_tensors(model, hf_config, device))


def hf_tensors(model: GPTModel, hf_config: Any, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face checkpoint names, detached (fused tensors are split into copies),
    whole, on ``device`` (None: the model's), one at a time: under tensor parallelism every rank must take them
    or call :func:`unsharded_weights`. Each tensor is gathered, converted and moved before the next, so on
    another device the model's own holds one whole tensor at a time."""
    maps = {tensor_map.megatron_name: tensor_map for tensor_map in _tensor_maps(hf_config)}
    for name, whole in unsharded_weights(model):
        yield from _split_to_hf(maps[name], whole, device)


def unsharded_weights(model: GPTModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of the model's tensors whole, by Megatron name, one gather at a time: a rank that only takes part
    in the gathers and drops each tensor holds one whole tensor at a time, not the whole model."""
    for name, tensor in model_tensors(model).items():
        yield name, _unshard(name, tensor).detach()


class CheckpointFiles(Mapping[str, torch.Tensor]):
    """A Hugging Face folder's safetensors tensors by name, each read from its file when asked for.

    Every trainer rank loads the checkpoint to keep its share; read whole, it would sit in each rank's host
    memory at once (Qwen3-30B-A3B: 61 GB, eight times over on an 8-GPU host)."""

    def __init__(self, files: Sequence[Path]) -> None:
        from safetensors import safe_open

        self._where: dict[str, Any] = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():
                if name in self._where:
                    raise ValueError(f"{name} is in two safetensors files of {file.parent} (the second: {file.name}); "
                                     "remove the stale one")
                self._where[name] = handle

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_hf_folder(folder: str | Path) -> tuple[Any, CheckpointFiles]:
    """The config and the safetensors tensors of a Hugging Face model folder (read as they are used)."""
    from transformers import AutoConfig

    folder = check_model_folder(folder, tokenizer=False)
    return AutoConfig.from_pretrained(folder), CheckpointFiles(sorted(folder.glob("*.safetensors")))


def write_hf_folder(folder: str | Path, hf_config: Any, hf_state: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` and ``model.safetensors`` as ``save_pretrained`` would (one shard)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(folder)
    save_file({name: tensor.contiguous() for name, tensor in hf_state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})


# --- forward, log-probs, routing replay ------------------------------------------------------------------------


@dataclasses.dataclass
class ForwardOutput:
    """What one forward gives: the logits, and the experts chosen when they were recorded."""

    logits: torch.Tensor  # [batch, seq, vocab], or this rank's share of the vocabulary (whole_vocabulary=False)
    experts: torch.Tensor | None  # [batch, seq, moe_layers, top_k] int64, or None


def _replay_handles(model: GPTModel, required: bool = True) -> list[RouterReplay]:
    """The RouterReplay handle of each MoE layer of ``model``, in layer order; none (unless ``required``) for
    a model built without them.

    megatron-core also keeps every handle ever created in a class-level list
    (``RouterReplay.global_router_replay_instances``); that list spans every
    model built in the process, so vime addresses the model's own handles.
    """
    handles = [module.router_replay for module in model.modules() if isinstance(module, TopKRouter)]
    if not required and (not handles or handles[0] is None):
        return []
    if not handles or any(handle is None for handle in handles):
        raise ValueError("recording or replaying experts needs an MoE model built with routing_replay=True")
    return handles


def _sequence_ranks(model: GPTModel) -> tuple[int, int]:
    """``(rank, ranks)`` among which sequence parallelism splits ``model``'s tokens; ``(0, 1)`` without it."""
    if not model.config.sequence_parallel:
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _route_free_tokens(experts: torch.Tensor) -> torch.Tensor:
    """``experts`` with each free token (-1 in every slot) sent to experts ``0..top_k-1``: megatron-core's
    routers need top_k distinct experts for every token they see (its alltoall dispatcher counts exactly
    top_k per token), and free tokens are ones no kept log-prob depends on."""
    ids = torch.arange(experts.shape[-1], dtype=experts.dtype, device=experts.device)
    return torch.where(experts < 0, ids, experts)


@contextlib.contextmanager
def _routing(model: GPTModel, shape: tuple[int, int], width: int, experts: torch.Tensor | None,
             record: bool) -> Iterator[list[RouterReplay]]:
    """Record or replay experts for a ``shape`` batch padded to ``width`` positions (padding is routed like a
    free token). Megatron's routers see tokens sequence-major, token (position p, row r) as number
    ``p * batch + r``, and under sequence parallelism each rank's routers see only its share of those.

    A replay in a training forward of a recomputing model outlives the call: the backward pass runs each
    layer's forward again, which must route as the first did. The next call (or :func:`end_replay`) ends
    it. That holds because each backward follows its own forward; interleaved micro-batches (pipeline
    parallelism) would need megatron-core's queue of replays for the backward pass instead."""
    recomputing = model.config.recompute_granularity == "full"
    if recomputing:
        end_replay(model)
    if experts is None and not record:
        yield []
        return
    handles = _replay_handles(model)
    kept = experts is not None and recomputing and model.training and torch.is_grad_enabled()
    if experts is not None:
        batch, seq = shape
        if experts.shape[:3] != (batch, seq, len(handles)):
            raise ValueError(f"experts of shape {tuple(experts.shape)} do not fit a batch of {batch} x {seq} tokens "
                             f"through {len(handles)} MoE layers: pass [batch, seq, moe_layers, top_k]")
        experts = _route_free_tokens(F.pad(experts.to(torch.long), (0, 0, 0, 0, 0, width - seq), value=-1))
        rank, ranks = _sequence_ranks(model)
        per_layer = experts.permute(2, 1, 0, 3).reshape(len(handles), width * batch, -1).chunk(ranks, dim=1)[rank]
    try:
        for layer, handle in enumerate(handles):
            if experts is not None:
                handle.set_target_indices(per_layer[layer])
                handle.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            else:
                handle.set_router_replay_action(RouterReplayAction.RECORD)
        yield handles
    finally:
        if not kept:
            _route_freely(handles)


def _check_replayable(experts: torch.Tensor) -> None:
    """A ValueError unless each row of ``experts [rows, width, layers, top_k]`` has experts up to a point and
    none after it (a response's last token and the padding), past its first position."""
    unrouted = experts.amax(dim=(-2, -1)) < 0  # [rows, width]; free positions hold -1 throughout
    first = unrouted.int().argmax(dim=1, keepdim=True)
    tail = torch.arange(unrouted.shape[1], device=unrouted.device) >= first
    if not torch.equal(unrouted, tail) or not first.all():
        raise ValueError("replayed experts must cover every position of a row but its last and the padding; "
                         "a sample without recorded experts cannot be replayed by the Megatron trainer")


def end_replay(model: GPTModel) -> None:
    """Drop the experts a recomputing model's replay kept past its forward, for the backward pass."""
    _route_freely(_replay_handles(model, required=False))


def _route_freely(handles: list[RouterReplay]) -> None:
    for handle in handles:
        handle.clear_indices()
        handle.clear_router_replay_action()


def forward(model: GPTModel, input_ids: torch.Tensor, *, replay_experts: torch.Tensor | None = None,
            record_experts: bool = False, whole_vocabulary: bool = True) -> ForwardOutput:
    """Logits of right-padded ``input_ids [batch, seq]``, routing freely, recording, or replaying experts.

    ``replay_experts [batch, seq, moe_layers, top_k]`` (R3) makes every MoE
    layer send each token to those experts; the gate weights are the router's
    live scores at them, so the router still learns. Positions past a row's
    last real token may hold any top_k distinct expert ids. ``record_experts`` returns
    the experts the routers chose, in that same layout. Under tensor
    parallelism each rank computes the logits of its share of the vocabulary;
    ``whole_vocabulary`` gathers them (see :func:`vocab_parallel_token_stats`
    for what needs no gathering).
    """
    batch, seq = input_ids.shape
    _, ranks = _sequence_ranks(model)
    width = -(-seq // ranks) * ranks  # sequence parallelism cuts the positions evenly; right padding is harmless
    input_ids = F.pad(input_ids, (0, width - seq))
    positions = torch.arange(width, device=input_ids.device).expand(batch, width)
    with _routing(model, (batch, seq), width, replay_experts, record_experts) as handles:
        logits = model(input_ids=input_ids, position_ids=positions, attention_mask=None)[:, :seq]
        if whole_vocabulary and parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        experts = None
        if record_experts:
            recorded = _gather_sequence(torch.stack([handle.get_recorded_indices() for handle in handles]), ranks)
            experts = recorded.reshape(len(handles), width, batch, -1).permute(2, 1, 0, 3)[:, :seq].contiguous()
    return ForwardOutput(logits=logits, experts=experts)


def _gather_sequence(local: torch.Tensor, ranks: int) -> torch.Tensor:
    """``[layers, tokens, k]`` of every rank's share of the tokens, joined in rank order (a collective)."""
    if ranks == 1:
        return local
    pieces = [torch.empty_like(local) for _ in range(ranks)]
    dist.all_gather(pieces, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=1)


def vocab_parallel_token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                               entropy_grad: bool = False,
                               piece_elements: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vime.backends.hf.token_stats` from this tensor-parallel rank's share of the vocabulary
    (``logits [rows, positions, vocab / ranks]``, the ranks' shares in rank order), without any rank holding
    the whole vocabulary's logits. Those are the training step's largest tensors: at Qwen3's 151,936 tokens,
    4 responses of 9,000 tokens make 11 GB of bf16 logits per rank, and the eager fp32 chain to a log-prob
    several times that. Here a rank keeps for the backward pass the model's output of its share (prompt
    positions too, an eighth of the whole at TP8) and four numbers per token, and works through it in pieces
    of at most ``piece_elements`` (or one position's share, where that is more), two fp32 tensors of a
    piece's size at a time: 512 MB by default."""
    first = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    chosen, entropy = _VocabParallelStats.apply(logits, targets, temperature, first,
                                                parallel_state.get_tensor_model_parallel_group(), piece_elements)
    return chosen, entropy if entropy_grad else entropy.detach()


class _VocabParallelStats(torch.autograd.Function):
    """Log-probs and entropies from vocabulary shares: per token, one max and one sum of three numbers over
    the ranks (one collective each for all tokens). Every rank computes the same loss from them, so each
    gets the same gradients of the two outputs and can write its share's gradient alone; the softmax is
    recomputed for it, not saved."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, first: int,
                group: dist.ProcessGroup, piece_elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        peak = logits.amax(-1).float() / temperature  # the max of the scaled logits, without an fp32 copy
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        sums = torch.empty(*peak.shape, 3, device=peak.device)
        tokens = max(1, piece_elements // logits.shape[-1])
        for piece, piece_peak, piece_targets, piece_sums in zip(*(_pieces(t, tokens) for t in (
                logits, peak, targets, sums))):
            shifted = piece.float() / temperature
            shifted -= piece_peak.unsqueeze(-1)
            exps = shifted.exp()
            index, mine = _in_share(piece_targets, first, shifted.shape[-1])
            piece_sums[:, 0] = exps.sum(-1)
            piece_sums[:, 1] = torch.einsum("tv,tv->t", exps, shifted)
            piece_sums[:, 2] = torch.where(mine, shifted.gather(-1, index).squeeze(-1), 0.0)  # clamped index: out
        dist.all_reduce(sums, group=group)
        total, weighted, target = sums.unbind(-1)
        mean = weighted / total  # the shifted logits' mean under the softmax
        ctx.save_for_backward(logits, targets, peak, total, mean)
        ctx.temperature, ctx.first, ctx.tokens = temperature, first, tokens
        ctx.set_materialize_grads(False)
        return target - total.log(), total.log() - mean

    @staticmethod
    def backward(ctx: Any, chosen_grad: torch.Tensor | None,
                 entropy_grad: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits, targets, peak, total, mean = ctx.saved_tensors
        grads = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        pieces = [itertools.repeat(None) if tensor is None else _pieces(tensor, ctx.tokens)
                  for tensor in (logits, grads, peak, total, mean, targets, chosen_grad, entropy_grad)]
        for piece, out, *stats in zip(*pieces):
            out.copy_(_share_grad(piece, *stats, ctx.temperature, ctx.first))
        return grads, None, None, None, None, None


def _share_grad(logits: torch.Tensor, peak: torch.Tensor, total: torch.Tensor, mean: torch.Tensor,
                targets: torch.Tensor, chosen_grad: torch.Tensor | None, entropy_grad: torch.Tensor | None,
                temperature: float, first: int) -> torch.Tensor:
    """The gradient of a piece of a share's logits ``[tokens, share]``:
    d/d shifted_v of (g_c log p_t + g_e entropy) = g_c [v == t] - p_v (g_e (shifted_v - mean) + g_c),
    in place in two fp32 tensors of the piece's size."""
    grad = logits.float() / temperature
    grad -= peak.unsqueeze(-1)
    probs = grad.exp()
    probs /= total.unsqueeze(-1)
    if entropy_grad is not None:
        grad -= mean.unsqueeze(-1)
        grad *= entropy_grad.unsqueeze(-1)
    else:
        grad.zero_()
    if chosen_grad is not None:
        grad += chosen_grad.unsqueeze(-1)
    grad *= probs
    del probs
    grad.neg_()
    if chosen_grad is not None:
        index, mine = _in_share(targets, first, grad.shape[-1])
        grad.scatter_add_(-1, index, (chosen_grad * mine).unsqueeze(-1))
    grad /= temperature
    return grad


def _pieces(tensor: torch.Tensor, tokens: int) -> list[torch.Tensor]:
    """Views of ``tensor [rows, positions, ...]`` over at most ``tokens`` positions each, row after row (the
    trainer's logits are a view of the model's output that no reshape could flatten without a copy)."""
    return [piece for row in tensor for piece in row.split(tokens)]


def _in_share(targets: torch.Tensor, first: int, share: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each target falls in a share of the vocabulary from ``first`` (clamped: ``[..., 1]``), and
    whether it falls there at all."""
    local = targets - first
    return local.clamp(0, share - 1).unsqueeze(-1), (local >= 0) & (local < share)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) under ``softmax(logits / temperature)``, fp32: ``[batch, seq - 1]``.

    The same formula as the rollout engines and the reference trainer
    (``scaled_logprobs``), so the three agree to float rounding.
    """
    logprobs = scaled_logprobs(logits[:, :-1], temperature)
    return logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


# --- the train engine ------------------------------------------------------------------------------------------


class _AsCausalLM(torch.nn.Module):
    """A GPTModel called the way the reference trainer calls a transformers causal LM.

    The reference trainer's step (score, advantages, mini- and micro-batches,
    loss, clipping, AdamW, schedule) is written against
    ``model(input_ids=, attention_mask=, position_ids=).logits``; answering
    that call lets :class:`MegatronTrainEngine` run the very same step. The
    trainer's batches are right-padded and trimmed, so the mask and positions
    it passes are those the causal GPTModel assumes anyway. Under tensor
    parallelism its logits are this rank's share of the vocabulary, which the
    engine's ``_token_stats`` takes as they are; anything else must gather them.
    """

    def __init__(self, model: GPTModel, config: Any) -> None:
        super().__init__()
        self.model = model
        self.config = config  # the Hugging Face config, as a transformers model carries it
        self.replay_experts: torch.Tensor | None = None  # set by MegatronTrainEngine._replaying

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> ForwardOutput:
        """This rank's share of the vocabulary's logits: :meth:`MegatronTrainEngine._token_stats` sums over
        the ranks."""
        return forward(self.model, input_ids, replay_experts=self.replay_experts, whole_vocabulary=False)


class MegatronTrainEngine(TorchTrainEngine):
    """The trainer on a megatron-core GPTModel, with the reference trainer's training step.

    Everything algorithmic -- log-prob recomputation, advantages, the policy
    loss of ``vime.algorithms``, mini- and micro-batches, clipping, AdamW and
    the schedule -- is inherited from :class:`TorchTrainEngine`, so the two
    backends cannot drift apart; this class supplies the model (built from
    the Hugging Face config, weights converted on load) and the conversions
    back to Hugging Face names for weight sync, ``save_hf`` and checkpoints.
    ``dtype="bf16"`` trains bf16 weights with fp32 masters, as the reference
    trainer does.

    With several ranks (``tensor_parallel`` x ``data_parallel``, of a
    ``torchrun`` launch or led by ``vime.backends.tensor_parallel`` in the
    pipeline) every rank builds this engine and makes the same calls with
    the same batches: each holds its shard of the weights (with
    ``expert_parallel``, whole experts of its own), masters and optimizer
    state; each data-parallel copy runs its share of the samples
    (:func:`~vime.backends.torch_train.replica_micro_batches`) and the
    gradients are summed over the copies; the gradient norm is taken over
    the whole model, and ``named_weights`` gathers whole tensors on every
    rank. Rank 0 writes the Hugging Face folder; each rank writes its own
    trainer state.

    GRPO only for now: PPO's value model is a Hugging Face backbone there.
    """

    def __init__(self, model_path: str, *, algo: str, optim: OptimConfig, loss: PolicyLossConfig,
                 grpo_config: grpo.GRPOConfig, ppo_config: ppo.PPOConfig, temperature: float, dtype: str = "fp32",
                 total_steps: int = 1, seed: int = 0, tensor_parallel: int = 1, expert_parallel: int = 1,
                 data_parallel: int = 1, recompute: bool = False) -> None:
        if algo != "grpo":
            raise NotImplementedError(f"the Megatron trainer runs grpo only so far, not {algo!r}; "
                                      "use the torch trainer for ppo")
        self.hf_config, self._checkpoint = read_hf_folder(model_path)
        self.tensor_parallel, self.expert_parallel, self.recompute = tensor_parallel, expert_parallel, recompute
        self.data_parallel = data_parallel
        super().__init__(model_path, algo=algo, optim=optim, loss=loss, grpo_config=grpo_config,
                         ppo_config=ppo_config, temperature=temperature, dtype=dtype, total_steps=total_steps,
                         seed=seed, device="cuda" if torch.cuda.is_available() else "cpu")
        del self._checkpoint
        # the optimizer's tensors (the masters in bf16, the parameters themselves in fp32) that hold a shard, and
        # the whole ones whose gradient each rank sees only part of (marked ``sequence_parallel``): norms and
        # routers act on the rank's share of the tokens, q/k norms on its own heads
        trained = [(name, param) for name, param in self.policy.named_parameters() if param.requires_grad]
        tensors = self.optimizer.param_groups[0]["params"]  # the trainable parameters' (or masters'), in order
        self._split = {id(tensor) for tensor, (_, param) in zip(tensors, trained)
                       if getattr(param, "tensor_model_parallel", False)}
        self._partial = {id(tensor) for tensor, (_, param) in zip(tensors, trained)
                         if getattr(param, "sequence_parallel", False)}
        self._experts = {id(tensor) for tensor, (_, param) in zip(tensors, trained) if hasattr(param, "expert_split")}
        self.replica = (parallel_state.get_data_parallel_rank(), data_parallel)
        self.layout = {"train_backend": "megatron", "tensor_parallel": tensor_parallel,
                       "data_parallel": data_parallel, "expert_parallel": expert_parallel}

    def _load_policy(self, model_path: str) -> _AsCausalLM:
        return self._policy(self._checkpoint)

    @contextlib.contextmanager
    def _replaying(self, model: torch.nn.Module, experts: torch.Tensor | None) -> Iterator[None]:
        """R3 through megatron-core's RouterReplay, which needs an expert for every position: the free ones
        (-1: a response's last token, padding) get any valid ids, since no kept log-prob depends on them. That
        the others are all there is checked once per step, for the whole batch (:meth:`train_step`)."""
        if experts is None:
            yield
            return
        model.replay_experts = _route_free_tokens(experts).to(self.device)
        try:
            yield
        finally:
            model.replay_experts = None

    def _policy(self, checkpoint: Mapping[str, torch.Tensor]) -> _AsCausalLM:
        model = build_model(self.hf_config, routing_replay=self.hf_config.model_type in MOE_MODEL_TYPES,
                            tensor_parallel=self.tensor_parallel, expert_parallel=self.expert_parallel,
                            data_parallel=self.data_parallel, recompute=self.recompute)
        load_hf_weights(model, checkpoint, self.hf_config)
        return _AsCausalLM(model, self.hf_config).eval()

    def _token_stats(self, logits: torch.Tensor, targets: torch.Tensor,
                     entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tensor_parallel == 1:
            return super()._token_stats(logits, targets, entropy_grad)
        return vocab_parallel_token_stats(logits, targets, self.temperature, entropy_grad)

    def train_step(self, batch: TensorBatch) -> dict[str, Any]:
        """The reference trainer's step; the experts the last micro-batch replayed, kept for its backward pass
        when the layers recompute, are dropped after it. Experts that cannot be replayed are refused first, by
        every rank (each holds the whole batch): one refusing in a micro-batch that the other data-parallel
        copies do not run would leave them waiting in their next collective."""
        batch = batch.to(self.device)  # checked where the step reads them (on the host, seconds for a large batch)
        if batch.routed_experts is not None:
            _check_replayable(batch.routed_experts)
        try:
            return super().train_step(batch)
        finally:
            if self.recompute:
                end_replay(self.policy.model)

    def _clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Complete the gradients, then take the norm over the whole model and clip to it.

        Each data-parallel copy's gradients are of its share of the batch's samples (the loss normalised
        by the whole batch), so they are summed over the copies: an expert's over the copies that hold it.
        Under tensor parallelism the norms' and routers' gradients are of the rank's share of the positions
        and are summed over its copy's ranks. The norm then counts each shard once (squares summed over the
        ranks that divide the tensor) and each whole tensor once, since every rank now holds the same
        gradient of it."""
        grads = {id(param): param.grad for param in params if param.grad is not None}
        experts = [grad for key, grad in grads.items() if key in self._experts]
        _sum_over([grad for key, grad in grads.items() if key not in self._experts],
                  parallel_state.get_data_parallel_group())
        _sum_over(experts, parallel_state.get_expert_data_parallel_group())
        if dist.get_world_size() == 1:
            return super()._clip_gradients(params, max_norm)
        _sum_over([grad for key, grad in grads.items() if key in self._partial],
                  parallel_state.get_tensor_model_parallel_group())
        squares = torch.zeros((), device=self.device)
        for shards, group in (([grad for key, grad in grads.items() if key in self._split and key not in self._experts],
                               parallel_state.get_tensor_model_parallel_group()),
                              (experts, parallel_state.get_expert_tensor_and_model_parallel_group())):
            part = (torch.nn.utils.get_total_norm(shards) ** 2).to(self.device)  # a CPU zero when there are none
            dist.all_reduce(part, group=group)
            squares += part
        whole = [grad for key, grad in grads.items() if key not in self._split]
        total = (squares + torch.nn.utils.get_total_norm(whole).to(self.device) ** 2).sqrt()
        torch.nn.utils.clip_grads_with_norm_(list(grads.values()), max_norm, total)
        return total

    def _sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.data_parallel == 1:
            return tensor
        summed = tensor.to(self.device)
        dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
        return summed.to(tensor.device)

    def named_weights(self, device: str | None = None) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint names, as vLLM loads them (the fused q/k/v and gate/up are split into copies);
        whole tensors, so under tensor parallelism every rank must call this or :meth:`join_weight_gather`."""
        return hf_weights(self.policy.model, self.hf_config, device)

    def rollout_weights(self, dtype: torch.dtype, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in hf_tensors(self.policy.model, self.hf_config):  # converted where it was gathered
            yield name, tensor.to(dtype).to(device)

    def join_weight_gather(self) -> None:
        """A follower rank's part of the leader's :meth:`named_weights`: the same gathers, nothing kept."""
        for _ in unsharded_weights(self.policy.model):
            pass

    def save_hf(self, folder: Path) -> None:
        """Rank 0 writes the folder from host copies, one tensor gathered at a time; the others join."""
        if dist.get_rank() == 0:
            write_hf_folder(folder, self.hf_config, self.named_weights("cpu"))
        else:
            self.join_weight_gather()
        dist.barrier()

    def save(self, folder: Path) -> None:
        """Returns once every rank has written its part: the checkpoint is complete when the caller seals it."""
        super().save(folder)
        dist.barrier()

    def _state_file(self, folder: Path) -> Path:
        if dist.get_world_size() == 1:
            return super()._state_file(folder)
        copy = f"-dp{parallel_state.get_data_parallel_rank()}" if self.data_parallel > 1 else ""
        experts = "-ep" if self.expert_parallel > 1 else ""  # its optimizer state holds other tensors
        return folder / f"trainer-tp{parallel_state.get_tensor_model_parallel_rank()}{copy}{experts}.pt"

    def _load_policy_weights(self, folder: Path) -> None:
        load_hf_weights(self.policy.model, read_hf_folder(folder)[1], self.hf_config)
