"""The GPTModel of a Hugging Face config (a policy, or PPO's value model: a scalar head in place of the
output layer), and its forward pass: logits or values, routing freely, recording or replaying experts.

:func:`build_model` puts vime's layers (``modules``) in megatron-core's layer spec for the config that
``conversion`` maps; it leaves the weights uninitialised (``weights.load_hf_weights`` fills them). How
experts are recorded and replayed is ``routing``'s; log-probs from the logits are ``logprobs``'.

The rotary embedding uses positions ``0..seq-1`` of each row, so batches are right-padded (as
``vime.backends.base.collate`` pads them): padding then sits after every real token and, under causal
attention, cannot change a real token's output. A packed row (``vime.backends.packing``: samples end to end,
``position_ids`` restarting at 0 in each) is passed to megatron-core with the samples' bounds as
``PackedSeqParams`` (for the core attention, ``modules.SDPAttention``, to keep each token to its sample), and
its rotary embedding is taken at each token's own position in its sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_layer import MoESubmodules

from vime.architecture import moe_layer_pattern
from vime.backends import cpu_compat
from vime.backends.megatron.conversion import transformer_config
from vime.backends.megatron.modules import GroupedExperts, SDPAttention, SequenceParallelRMSNorm, ValueHead
from vime.backends.megatron.parallel import _gather_sequence, _sequence_ranks, init_parallel, stage_layers
from vime.backends.megatron.routing import _routing, _stage_moe_layers
from vime.backends.packing import documents, host_to_device


def build_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32, routing_replay: bool = False,
                tensor_parallel: int = 1, expert_parallel: int = 1, data_parallel: int = 1,
                recompute: bool = False, value_head: bool = False, pipeline_parallel: int = 1) -> GPTModel:
    """An uninitialised GPTModel of ``hf_config``'s shape: load weights with :func:`load_hf_weights`.

    ``routing_replay`` gives every MoE router a ``RouterReplay`` handle, for
    :func:`forward` to record or replay experts. With ``tensor_parallel`` > 1
    this process holds its rank's shard, and its logits cover its share of
    the vocabulary (:func:`forward` gathers them); ``expert_parallel`` and
    ``data_parallel`` (see :func:`init_parallel`) decide how an MoE model's
    experts are shared; ``recompute``: see :func:`transformer_config`. ``value_head``: PPO's value model, a
    :class:`ValueHead` in place of the output layer (its logits are then one value per position; on a last
    pipeline stage, where it is); its embedding is not tied to it, whatever ``tie_word_embeddings`` says.

    With ``pipeline_parallel`` > 1 this process holds its stage's slice of the layers: the embedding on the
    first stage, the final norm and the output layer on the last: for a tied model (``tie_word_embeddings``)
    megatron-core's copy of the embedding, which it starts from the first stage's (the engine sums the two
    copies' gradients). An MoE model's stages may recompute their layers: ``routing._routing`` queues each
    micro-batch's replayed experts for its backward pass.
    """
    if expert_parallel > 1 and not any(moe_layer_pattern(hf_config)):
        raise ValueError(f"--expert-model-parallel-size divides an MoE model's experts; this "
                         f"{hf_config.model_type} model has none: leave it at 1")
    init_parallel(tensor_parallel, expert_parallel, data_parallel, pipeline_parallel)
    config = transformer_config(hf_config, params_dtype=params_dtype, routing_replay=routing_replay,
                                tensor_parallel=tensor_parallel, expert_parallel=expert_parallel, recompute=recompute,
                                pipeline_parallel=pipeline_parallel)
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
    held = stage_layers(hf_config.num_hidden_layers)  # the spec holds this stage's layers only
    if replaced != sum(moe_layer_pattern(hf_config)[held.start:held.stop]):
        raise RuntimeError("megatron-core's MoE layer specs are not shaped as in 0.19.2: vime cannot give them "
                           "its GroupedExperts; install megatron-core 0.19.2")
    rope = hf_config.rope_parameters
    with cpu_compat.cuda_tensors_on_cpu():  # a tied last stage moves its copy of the embedding with .cuda()
        model = GPTModel(
            config=config, transformer_layer_spec=block, vocab_size=hf_config.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
            rotary_percent=rope.get("partial_rotary_factor", 1.0), rotary_base=rope["rope_theta"],
            # a value model's output layer is its head, tied to nothing: no copy of the embedding on a last stage
            share_embeddings_and_output_weights=hf_config.tie_word_embeddings and not value_head, parallel_output=True,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage())
    if value_head and model.post_process:  # only the last stage has an output layer to replace
        model.output_layer = ValueHead(config)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


@dataclasses.dataclass
class ForwardOutput:
    """What one forward gives: the logits, and the experts chosen when they were recorded."""

    # [batch, seq, vocab], or this rank's share of the vocabulary (whole_vocabulary=False); a value model's values
    # [batch, seq, 1], whole on every rank; on a pipeline stage before the last, the hidden states it hands on,
    # [positions (this rank's under sequence parallelism, padded), batch, hidden]
    logits: torch.Tensor
    experts: torch.Tensor | None  # [batch, seq, moe_layers, top_k] int64, or None


def forward(model: GPTModel, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
            sample_lengths: torch.Tensor | None = None, replay_experts: torch.Tensor | None = None,
            record_experts: bool = False, whole_vocabulary: bool = True) -> ForwardOutput:
    """Logits of right-padded ``input_ids [batch, seq]``, routing freely, recording, or replaying experts.

    With ``position_ids [1, seq]``, ``input_ids [1, seq]`` is one packed row: samples end to end, each one's
    positions from 0 (``vime.backends.packing.packed_inputs``), their lengths ``sample_lengths`` on the host
    (the attention's bounds, which the host would otherwise have to wait for the device to read). Each token
    then attends only to its own sample's tokens and takes the rotary embedding of its position in it, so its
    logits are those it has in a padded row of its own.

    ``replay_experts [batch, seq, moe_layers, top_k]`` (R3) makes every MoE
    layer send each token to those experts; the gate weights are the router's
    live scores at them, so the router still learns. Positions past a row's
    last real token may hold any top_k distinct expert ids. ``record_experts`` returns
    the experts the routers chose, in that same layout. Under tensor
    parallelism each rank computes the logits of its share of the vocabulary;
    ``whole_vocabulary`` gathers them (see :func:`vocab_parallel_token_stats`
    for what needs no gathering). On a pipeline stage, the model takes its input from the stage before (as
    megatron-core's schedule sets it) and ``input_ids`` give only the batch's shape (a packed row's
    ``position_ids`` and ``sample_lengths`` are still needed: every stage keeps each token to its sample by the
    lengths and takes its rotary embedding at its own position); a stage before the last returns its output as it
    goes to the next stage.
    ``replay_experts`` are then still the whole model's (every MoE layer's), of which the stage replays its own
    layers'; recording needs the whole model.
    """
    if model.config.pipeline_model_parallel_size > 1:
        if record_experts:
            raise ValueError("recording experts needs the whole model, and this one is a pipeline stage: record "
                             "them in the rollout engine (--use-rollout-routing-replay)")
        if replay_experts is not None:  # a stage of dense layers only (GLM's first ones, say) replays nothing
            stage = _stage_moe_layers(model)
            replay_experts = replay_experts[:, :, stage] if stage.stop > stage.start else None
    batch, seq = input_ids.shape
    _, ranks = _sequence_ranks(model)
    width = -(-seq // ranks) * ranks  # sequence parallelism cuts the positions evenly; right padding is harmless
    input_ids = F.pad(input_ids, (0, width - seq))
    arange = torch.arange(width, device=input_ids.device)
    packed = None
    if position_ids is None:
        positions = arange.expand(batch, width)
    else:
        if sample_lengths is not None and sample_lengths.device.type != "cpu":
            raise ValueError(f"sample_lengths are on {sample_lengths.device}; pass them on the host (as "
                             "vime.backends.packing.SampleSizes.of(batch) reads them, before the batch moves): "
                             "reading them from the device would make the host wait for it in every forward")
        if batch != 1 or sample_lengths is None or int(sample_lengths.sum()) != seq:
            raise ValueError(f"position_ids mark the samples of one packed row, whose sample_lengths (on the host) add "
                             f"up to its {seq} tokens; got {batch} rows and lengths {sample_lengths}: pack them "
                             "with vime.backends.packing.packed_inputs, or pass right-padded rows without either")
        positions = torch.cat([position_ids, arange[:width - seq].unsqueeze(0)], dim=1)  # the padding: a sample
        if width > seq:
            sample_lengths = torch.cat([sample_lengths, sample_lengths.new_tensor([width - seq])])
        cu_seqlens, longest = documents(sample_lengths)
        cu_seqlens = host_to_device(cu_seqlens, input_ids.device)
        # "sbhd": the row stays a sequence of one batch entry, as megatron-core lays out unpacked input; its "thd"
        # layout would apply the rotary embedding sample by sample, a host read and several kernels per sample
        # in every layer, where taking each token's own position (_at_positions) is one gather per forward
        packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
    with _routing(model, (batch, seq), width, replay_experts, record_experts) as handles, \
            _at_positions(model, None if packed is None else positions[0]):
        logits = model(input_ids=input_ids, position_ids=positions, attention_mask=None, packed_seq_params=packed)
        if not model.post_process:
            return ForwardOutput(logits=logits, experts=None)
        logits = logits[:, :seq]
        if (whole_vocabulary and parallel_state.get_tensor_model_parallel_world_size() > 1
                and not isinstance(model.output_layer, ValueHead)):
            logits = gather_from_tensor_model_parallel_region(logits)
        experts = None
        if record_experts:
            recorded = _gather_sequence(torch.stack([handle.get_recorded_indices() for handle in handles]), ranks)
            experts = recorded.reshape(len(handles), width, batch, -1).permute(2, 1, 0, 3)[:, :seq].contiguous()
    return ForwardOutput(logits=logits, experts=experts)


@contextlib.contextmanager
def _at_positions(model: GPTModel, positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, ``model``'s rotary embedding is taken at ``positions [seq]`` (each token's position in its
    packed sample) instead of ``0..seq-1``. megatron-core's GPTModel ignores ``position_ids`` under RoPE: it asks
    its rotary module for the first ``max_seqlen`` positions (``PackedSeqParams``: the longest sample's length),
    and this picks each token's row of those. The embedding is computed once per forward, before the layers, and
    handed to them (a recomputing layer gets it again from its checkpoint), so the hook is needed only around the
    call."""
    if positions is None:
        yield
        return
    handle = model.rotary_pos_emb.register_forward_hook(lambda module, args, output: output[positions])
    try:
        yield
    finally:
        handle.remove()
