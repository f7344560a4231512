"""A micro-batch's model inputs: right-padded rows, or its samples packed end to end into one row.

Both trainers (``torch_train`` and the Megatron backend, which inherits its step) feed a micro-batch to the
model through :class:`ModelInputs`. Padded (:func:`padded_inputs`), every sample is a row as wide as the
longest; packed (:func:`packed_inputs`, with ``--use-dynamic-batch-size``), the samples follow one another in a
single row with no padding, and the model is told where each begins by its position ids, which restart at 0
in every sample. That is the convention of transformers (``find_packed_sequence_indices``: a position that
does not follow the previous one starts a document), so the reference trainer's Hugging Face model needs
nothing else; the Megatron model reads the same positions (:func:`documents`) for its rotary embedding and
its attention, which keeps each token to its own sample (:func:`document_mask`, or a variable-length kernel:
``megatron.modules``).

Per-token results come back from either layout by :meth:`ModelInputs.responses`: for each response token,
the value at the position that predicts it, ``[samples, max_response]``, as the loss reads them. A packed
row spends no compute on padding; the vocabulary-wide work then covers the prompts' positions too (a padded
batch skips the columns before its earliest response, which a packed row cannot do without copying).

Left out: packing several rows per micro-batch (one row holds the whole token budget), and splitting a
sample over two rows.
"""

from __future__ import annotations

import dataclasses

import torch

from vime.backends.base import TensorBatch
from vime.backends.hf import position_ids


@dataclasses.dataclass
class ModelInputs:
    """One forward's inputs for some of a batch's samples, and where each response token's prediction is."""

    input_ids: torch.Tensor  # [rows, width]: a row per sample (padded), or one row of every sample (packed)
    attention_mask: torch.Tensor | None  # [rows, width]; None when packed: the position ids mark the samples
    position_ids: torch.Tensor  # [rows, width]; packed: from 0 in each sample
    experts: torch.Tensor | None  # [rows, width, moe_layers, top_k] to replay (R3), laid out as input_ids
    first: int  # the first column whose output predicts a response token: the earlier ones need no log-prob
    index: torch.Tensor  # [samples, max_response]: the column, from ``first``, predicting each response token
    response_mask: torch.Tensor  # [samples, max_response]

    def model_kwargs(self) -> dict[str, torch.Tensor | bool | None]:
        """What a causal LM (or value model) is called with: ``input_ids``, ``attention_mask``, ``position_ids``, and
        ``use_cache=False``: a trainer never decodes, and transformers reads a packed row's samples from its
        positions only when no key/value cache is made (else each token would attend to the samples before it)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids,
                "use_cache": False}

    def next_tokens(self) -> torch.Tensor:
        """The token each column from ``first`` predicts. A sample's last column predicts what follows it (padding,
        or the next packed sample's first token, the last wraps around): never a response token."""
        return self.input_ids.roll(-1, dims=1)[:, self.first:]

    def responses(self, per_column: torch.Tensor) -> torch.Tensor:
        """``per_column [rows, width - first]`` (log-probs, entropies, values) read back per response token:
        ``[samples, max_response]``, 0 past each response. The unpacking of a packed row: its one row is
        expanded (a view) so that each sample's tokens are gathered from it as from its own row."""
        rows = per_column.expand(self.index.shape[0], -1)
        return rows.gather(1, self.index) * self.response_mask


def padded_inputs(batch: TensorBatch, rows: torch.Tensor) -> ModelInputs:
    """``rows`` of ``batch`` as right-padded rows, trimmed to the longest. One host read, taken before the forward
    is queued: the vocabulary-wide work skips the columns before the earliest response (``first``), which with
    long prompts and short responses are most of them."""
    bounds = torch.stack([batch.response_start[rows].min() - 1, batch.attention_mask[rows].sum(-1).max()])
    first, width = bounds.tolist()
    mask = batch.attention_mask[rows, :width]
    steps = torch.arange(batch.response_ids.shape[1], device=mask.device)
    index = (batch.response_start[rows].unsqueeze(1) - 1 + steps).clamp(max=width - 1) - first
    return ModelInputs(input_ids=batch.input_ids[rows, :width], attention_mask=mask, position_ids=position_ids(mask),
                       experts=None if batch.routed_experts is None else batch.routed_experts[rows, :width],
                       first=first, index=index, response_mask=batch.response_mask[rows])


def packed_inputs(batch: TensorBatch, rows: torch.Tensor) -> ModelInputs:
    """``rows`` of ``batch`` end to end in one row, each sample's prompt and response tokens and no padding, its
    positions from 0 (the model tells the samples apart by them), the replayed experts of each token with it.
    One host read (the samples' lengths), to lay the row out. ``rows`` may be on the host (a step's shuffle is):
    it joins the batch's device first, since it is indexed by a tensor there."""
    rows = rows.to(batch.input_ids.device)
    lengths = batch.attention_mask[rows].sum(-1)
    total = int(lengths.sum())
    offsets = lengths.cumsum(0) - lengths  # where each sample starts in the row
    sample = torch.repeat_interleave(torch.arange(len(rows), device=lengths.device), lengths, output_size=total)
    positions = torch.arange(total, device=lengths.device) - offsets[sample]
    source = rows[sample]  # each packed token's row of the batch; ``positions`` is its column there
    steps = torch.arange(batch.response_ids.shape[1], device=lengths.device)
    # the column predicting response token k of a sample: its response start - 1 + k, kept within the sample
    # (past its response the mask zeroes what is read)
    within = torch.minimum(batch.response_start[rows].unsqueeze(1) - 1 + steps, lengths.unsqueeze(1) - 1)
    return ModelInputs(input_ids=batch.input_ids[source, positions].unsqueeze(0), attention_mask=None,
                       position_ids=positions.unsqueeze(0),
                       experts=None if batch.routed_experts is None else
                       batch.routed_experts[source, positions].unsqueeze(0),
                       first=0, index=offsets.unsqueeze(1) + within, response_mask=batch.response_mask[rows])


def documents(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The samples of a packed row, from its ``position_ids [1, tokens]`` (a sample starts where they are 0):
    ``cu_seqlens`` (int32 ``[samples + 1]``, where each starts and the row's end) and the longest sample's
    length, as variable-length attention kernels take them. One host read: the positions are worked through on
    the host, which needs the longest length as a number anyway, and ``cu_seqlens`` goes back to their device."""
    positions = position_ids.reshape(-1).cpu()
    if positions.numel() and positions[0] != 0:
        raise ValueError(f"a packed row starts at position {int(positions[0])}, not 0: its first tokens would "
                         "belong to no sample; build it with vime.backends.packing.packed_inputs")
    starts = torch.nonzero(positions == 0).reshape(-1)
    cu_seqlens = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    return cu_seqlens.to(position_ids.device), int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def document_mask(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[tokens, tokens]`` bool, True where a query (row) may attend to a key (column): an earlier or the same
    token of its own sample. For attention kernels that take a mask rather than ``cu_seqlens``."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                      output_size=tokens)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=cu_seqlens.device).tril()
    return causal & (segment.unsqueeze(1) == segment.unsqueeze(0))
