"""R3 on the GPTModel: recording the experts each token is routed to, and replaying given experts,
through megatron-core's ``RouterReplay``, with the gate weights still differentiable.

``model.forward`` is where a forward records or replays; the Hugging Face models' own R3 is
``vime.backends.routing_replay``. Activation recomputation makes a replay outlive its forward, queued until
the backward pass has run the layers again (:func:`end_replay` drops what is left).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from vime.backends.megatron.parallel import _sequence_ranks


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


def _stage_moe_layers(model: GPTModel) -> slice:
    """Where a pipeline stage's MoE layers lie among the whole model's, as replayed experts hold them (one entry
    per MoE layer of the whole model, in layer order)."""
    offset = model.decoder.layers[0].layer_number - 1
    pattern = model.config.moe_layer_freq  # vime's configs give the pattern as a list, one 0 or 1 per layer
    first = sum(pattern[:offset])
    return slice(first, first + len(_replay_handles(model, required=False)))


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
    layer's forward again, which must route as the first did. Each such forward queues its experts in
    megatron-core's list of replays for the backward pass, and leaves the routers replaying from it
    (``REPLAY_BACKWARD``): each recomputed layer takes the oldest of its queue. In pipeline stages the 1F1B
    schedule runs later micro-batches' forwards before a backward, but the backward passes follow the
    forwards' order, so each takes its own forward's experts; with one stage each backward follows its own
    forward, and a call first drops whatever an earlier one left (a forward whose backward never ran). The
    engine drops the queue after a step (:func:`end_replay`)."""
    recomputing = model.config.recompute_granularity == "full"
    if recomputing and model.config.pipeline_model_parallel_size == 1:
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
        if kept:  # the experts stay queued for the backward pass's recomputation
            for handle in handles:
                handle.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        else:
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
