"""A micro-batch's model inputs: right-padded rows, or its samples packed end to end into one row.

Both trainers (``torch_train`` and the Megatron backend, which inherits its step) feed a micro-batch to the
model through :class:`ModelInputs`. Padded (:func:`padded_inputs`), every sample is a row as wide as the
longest; packed (:func:`packed_inputs`, with ``--use-dynamic-batch-size``), the samples follow one another in a
single row with no padding, and the model is told where each begins by its position ids, which restart at 0
in every sample. That is the convention of transformers (``find_packed_sequence_indices``: a position that
does not follow the previous one starts a document), so the reference trainer's Hugging Face model needs
nothing else; the Megatron model reads the same positions for its rotary embedding, and the samples' lengths
(:func:`documents`) for its attention, which keeps each token to its own sample (:func:`document_mask`, or a
variable-length kernel: ``megatron.modules``).

A micro-batch (:class:`MicroBatch`) is laid out from its samples' sizes on the host (:class:`SampleSizes`, read
from the device once per step), never from the device: on a GPU every such read would stall the host until the
queued forward and backward passes finished, and the next micro-batch could not be queued while the GPU works.
That holds for vime's code and dense models only: in an MoE layer megatron-core's token dispatcher still reads
the device in every micro-batch (``moe_utils.sort_chunks_by_idxs``' ``.tolist()``).

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
    sample_lengths: torch.Tensor | None  # packed: each sample's tokens, on the host (:func:`documents`); else None

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


@dataclasses.dataclass(frozen=True, eq=False)  # tensors: == would compare them element-wise
class SampleSizes:
    """What laying micro-batches out needs to know of samples, on the host: their tokens (prompt and response),
    where each response starts, and its response tokens (what weighs a micro-batch's statistics). Read from the
    device once per step (:meth:`of`), so that cutting and building micro-batches never waits for it: on a GPU
    each read stalls the host until the queued passes finish, and the next micro-batch could not be queued
    while the GPU works."""

    lengths: torch.Tensor  # [samples] int64
    response_start: torch.Tensor  # [samples] int64
    response_tokens: torch.Tensor  # [samples] float32: the response mask's sum

    @classmethod
    def of(cls, batch: TensorBatch) -> SampleSizes:
        """``batch``'s sizes, in one copy to the host (none when the batch is there already). float64 holds the
        counts and the mask's float32 sums exactly, so one tensor carries the three."""
        together = torch.stack([batch.attention_mask.sum(-1).double(), batch.response_start.double(),
                                batch.response_mask.sum(-1).double()]).cpu()
        return cls(together[0].long(), together[1].long(), together[2].float())

    def __getitem__(self, rows: torch.Tensor) -> SampleSizes:
        """The sizes of ``rows`` (host indices), in their order."""
        return SampleSizes(self.lengths[rows], self.response_start[rows], self.response_tokens[rows])


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """The samples of one forward (and backward) pass: their rows of the batch on its device, to index its
    tensors, and their sizes on the host, to lay the pass out without reading the device."""

    rows: torch.Tensor  # [samples] on the batch's device
    sizes: SampleSizes  # of ``rows``, in their order
    counted: bool = True  # False: a pass that only keeps data-parallel copies in step (``replica_micro_batches``)


def on_device(chunks: list[tuple[torch.Tensor, bool]], sizes: SampleSizes, device: str | torch.device
              ) -> list[MicroBatch]:
    """``chunks`` (host rows, whether each counts) as micro-batches of a batch on ``device`` whose samples have
    ``sizes``: every chunk's rows go over in one copy that does not wait for the device (:func:`host_to_device`)."""
    if not chunks:
        return []
    rows = host_to_device(torch.cat([rows for rows, _ in chunks]), device).split([len(rows) for rows, _ in chunks])
    return [MicroBatch(moved, sizes[host], counted) for moved, (host, counted) in zip(rows, chunks)]


def host_to_device(host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``host`` copied to ``device`` without the host waiting for the device, queued behind the work already
    there. On CUDA the copy is from page-locked memory, which is what makes it asynchronous: ``non_blocking`` from
    pageable memory does not wait for the stream either, but returns only once the driver has staged the data
    itself. A tensor not on the host is refused: it cannot be pinned, and reading it would make the host wait."""
    if host.device.type != "cpu":
        raise ValueError(f"host_to_device copies a host tensor; got one on {host.device}: take it on the host "
                         "(a batch's sizes by SampleSizes.of(batch) before the batch moves to the device)")
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def padded_inputs(batch: TensorBatch, micro: MicroBatch) -> ModelInputs:
    """``micro``'s samples of ``batch`` as right-padded rows, trimmed to the longest. The vocabulary-wide work
    skips the columns before the earliest response (``first``), which with long prompts and short responses are
    most of them; both bounds are the host's sizes, so the forward is queued without waiting for the device."""
    rows = micro.rows
    first, width = int(micro.sizes.response_start.min()) - 1, int(micro.sizes.lengths.max())
    mask = batch.attention_mask[rows, :width]
    steps = torch.arange(batch.response_ids.shape[1], device=mask.device)
    index = (batch.response_start[rows].unsqueeze(1) - 1 + steps).clamp(max=width - 1) - first
    return ModelInputs(input_ids=batch.input_ids[rows, :width], attention_mask=mask, position_ids=position_ids(mask),
                       experts=None if batch.routed_experts is None else batch.routed_experts[rows, :width],
                       first=first, index=index, response_mask=batch.response_mask[rows], sample_lengths=None)


def packed_inputs(batch: TensorBatch, micro: MicroBatch) -> ModelInputs:
    """``micro``'s samples of ``batch`` end to end in one row, each sample's prompt and response tokens and no
    padding, its positions from 0 (the model tells the samples apart by them), the replayed experts of each
    token with it. The row's length and the samples' bounds are the host's sizes: no read of the device."""
    rows = micro.rows
    lengths = batch.attention_mask[rows].sum(-1)
    total = int(micro.sizes.lengths.sum())
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
                       first=0, index=offsets.unsqueeze(1) + within, response_mask=batch.response_mask[rows],
                       sample_lengths=micro.sizes.lengths)


def documents(sample_lengths: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The samples of a packed row from their lengths (on the host): ``cu_seqlens`` (int32 ``[samples + 1]``,
    where each starts and the row's end, on the host) and the longest sample's length, as variable-length
    attention kernels take them."""
    cu_seqlens = torch.cat([sample_lengths.new_zeros(1), sample_lengths.cumsum(0)]).to(torch.int32)
    return cu_seqlens, int(sample_lengths.max())


def document_mask(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[tokens, tokens]`` bool, True where a query (row) may attend to a key (column): an earlier or the same
    token of its own sample. For attention kernels that take a mask rather than ``cu_seqlens``."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                      output_size=tokens)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=cu_seqlens.device).tril()
    return causal & (segment.unsqueeze(1) == segment.unsqueeze(0))
