"""Per-token log-probs under the sampling temperature, computed exactly as the rollout reports them
(``vime.backends.hf.scaled_logprobs``): from whole logits (:func:`token_logprobs`), or from a
tensor-parallel rank's share of the vocabulary without gathering it (:func:`vocab_parallel_token_stats`,
an autograd function of its own).

The logits come from ``model.forward``; the trainer's use of them is ``engine``'s.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from vime.backends.hf import scaled_logprobs


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
