"""The layers vime puts in megatron-core's layer spec in place of its own (no Transformer Engine).

A core attention on ``torch.nn.functional.scaled_dot_product_attention``, the one attention path on CPU
and GPU for right-padded rows (a packed row's, :func:`document_attention`, takes torch's variable-length flash
kernel on a GPU where it can); torch's RMSNorm, allowed under sequence parallelism; an MoE layer's routed experts as two
stacked weights in grouped matmuls (:class:`GroupedExperts`, in place of megatron-core's one-by-one
``SequentialMLP``; ``bench/experts.py``); and PPO's scalar value head in place of the output layer
(:class:`ValueHead`). Where they go in the spec is ``model.build_model``'s business;
how their weights map to a Hugging Face checkpoint is ``conversion``'s.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from vime.backends.packing import document_mask


class SDPAttention(MegatronModule):
    """Megatron core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Megatron's local ``DotProductAttention`` materialises the ``[b, heads, s, s]``
    score matrix; SDPA picks a fused kernel instead (flash attention on the
    GPU, a blocked kernel on CPU) and handles grouped-query attention without
    repeating the key/value heads. It replaces the local core attention on CPU
    and GPU alike, so tests and training run the same code; a packed row in
    bf16 on a GPU is the exception (:func:`document_attention` takes torch's
    variable-length kernel there, which a GPU test holds to each sample's own
    attention).

    Causal self-attention only, over right-padded rows, or over one packed
    row whose samples ``packed_seq_params`` bounds (``model.forward``): each
    token then attends to the earlier tokens of its own sample only
    (:func:`document_attention`).
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
        """``query [s, b, heads, d]``, ``key``/``value [s, b, groups, d]`` -> ``[s, b, heads * d]``; packed
        (``packed_seq_params``), ``b`` is 1."""
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention takes neither masks nor biases: right-pad the batch and rely "
                                      "on the causal mask, or pack it (vime.backends.packing)")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None:
            context = document_attention(query[:, 0], key[:, 0], value[:, 0], packed_seq_params.cu_seqlens_q,
                                         packed_seq_params.max_seqlen_q, self.softmax_scale, dropout)
            return context.reshape(context.shape[0], 1, -1)
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        context = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.softmax_scale,
            dropout_p=dropout, enable_gqa=query.shape[1] != key.shape[1])
        seq, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                       longest: int, scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each sample of a packed row: ``query [tokens, heads, d]``, ``key``/``value
    [tokens, groups, d]``, the samples starting at ``cu_seqlens`` (int32 ``[samples + 1]``, the last the row's
    end), the longest ``longest`` tokens -> ``[tokens, heads, d]``.

    The one place the kernel is chosen. On a GPU in bf16/fp16 without dropout, torch's variable-length flash
    attention (``torch.nn.attention.varlen``), which computes each sample's own triangle and nothing across
    samples. Otherwise (the CPU, fp32, attention dropout, which that kernel lacks) SDPA under a block-diagonal
    causal mask (``vime.backends.packing.document_mask``): ``tokens x tokens`` booleans, and the kernel works
    through the masked blocks too, so it costs what one padded row as long as the packed one would."""
    groups_differ = query.shape[1] != key.shape[1]
    varlen = _varlen_attention()
    if varlen is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not dropout:
        kernel, takes_groups = varlen
        grouped = {}
        if groups_differ and takes_groups:
            grouped = {"enable_gqa": True}
        elif groups_differ:  # each query head's key/value group, as SDPA's enable_gqa reads it
            key, value = (tensor.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for tensor in (key, value))
        return kernel(query, key, value, cu_seqlens, cu_seqlens, longest, longest, scale=scale, window_size=(-1, 0),
                      **grouped)
    mask = document_mask(cu_seqlens, query.shape[0])
    query, key, value = (tensor.transpose(0, 1).unsqueeze(0) for tensor in (query, key, value))
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, dropout_p=dropout,
                                             enable_gqa=groups_differ)
    return context[0].transpose(0, 1)


@functools.cache
def _varlen_attention() -> tuple[Callable[..., torch.Tensor], bool] | None:
    """``torch.nn.attention.varlen.varlen_attn``, and whether it takes grouped key/value heads (``enable_gqa``, as
    2.12 and 2.13 do; without, :func:`document_attention` repeats them for each query head), where it takes a
    causal window (``window_size``); else None, and :func:`document_attention` masks: the first releases of it
    took ``is_causal`` and no ``scale``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    return (varlen_attn, "enable_gqa" in parameters) if "window_size" in parameters else None


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


class ValueHead(MegatronModule):
    """PPO's value head, ``Linear(hidden, 1)``, in the GPTModel's ``output_layer`` place: a value model is the
    policy's architecture with a scalar per position instead of the vocabulary's logits.

    It is replicated, whole on every tensor-parallel rank, rather than row-parallel: the decoder's output
    reaches the output layer cut by sequence (sequence parallelism), each rank holding every hidden feature
    of its positions, so each rank computes the values of its own positions with no exchange, and one
    all-gather of ``[positions, batch]`` scalars makes them whole on every rank. A row-parallel head would
    first have to redistribute the hidden states by feature, a far larger exchange, to split a weight of
    ``hidden`` numbers. Every rank computes the same loss from the gathered values, so the gather's backward
    pass keeps each rank's share of their gradient (no reduction), and the head's gradient on a rank is that
    of its positions only: marked ``sequence_parallel``, as the norms are, it is summed over the ranks.

    It starts at zero (every value 0 until the value loss moves it), as the reference trainer's head does;
    the checkpoint's output layer, if any, is not used."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        """``hidden [positions (this rank's), batch, hidden]`` -> ``[positions (all), batch, 1]``, called as the
        GPTModel calls its output layer (``weight``: a tied embedding, which a value head does not use)."""
        values = F.linear(hidden, self.weight, self.bias)
        if self.config.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None
