"""The model's weights in and out: a Hugging Face checkpoint loaded into the model, each rank taking its
shard of every split tensor; the weights gathered whole again under Hugging Face names, for weight sync
and ``save_hf``; and Hugging Face folders read (lazily, tensor by tensor) and written.

Which Megatron tensor is made of which Hugging Face tensors is ``conversion``'s; here is only where
each piece of a tensor lives (``_shard``/``_unshard``) and the I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from vime.backends.hf import check_model_folder
from vime.backends.megatron.conversion import _converted, _split_to_hf, _tensor_maps
from vime.backends.megatron.modules import ValueHead
from vime.backends.megatron.parallel import stage_layers
from vime.backends.plain_collectives import gather_plain
from vime.transports.gpu import dtype_name, dtype_named

TIED_EMBEDDING = "embedding.word_embeddings.weight"  # a tied model's embedding, and its output layer


def model_tensors(model: GPTModel) -> dict[str, torch.Tensor]:
    """The model's live parameters and persistent buffers by name (no copies; ``_extra_state`` left out). A
    pipeline stage's layers are named by their place in the whole model (``decoder.layers.{offset + i}``), as
    the conversions to Hugging Face names and the checkpoint records know them, and the last stage's copy of a
    tied embedding by the embedding's name (:func:`_whole_model_name`)."""
    state = model.state_dict(keep_vars=True)
    return {whole: state[name] for name, whole in whole_model_names(model).items()
            if isinstance(state[name], torch.Tensor)}


def whole_model_names(model: GPTModel) -> dict[str, str]:
    """Each name of ``model.state_dict()`` (a pipeline stage's own layer numbers) -> the whole model's name of that
    entry (:func:`_whole_model_name`): the names a checkpoint keeps PPO's value model by, which a trainer of other
    stages can find its own among."""
    offset = layer_offset(model)
    return {name: _whole_model_name(name, value, offset) for name, value in model.state_dict(keep_vars=True).items()}


def named_parameters(model: GPTModel) -> dict[str, torch.nn.Parameter]:
    """``model.named_parameters()`` in their order, the layers named by their place in the whole model (as
    :func:`model_tensors` names them): the names a checkpoint's optimizer state is recorded by, which a trainer
    of other pipeline stages can find its own parameters among."""
    offset = layer_offset(model)
    return {_whole_model_name(name, param, offset): param for name, param in model.named_parameters()}


def layer_offset(model: GPTModel) -> int:
    """How many layers of the whole model come before this pipeline stage's first (0 without stages)."""
    return model.decoder.layers[0].layer_number - 1


def _whole_model_name(name: str, tensor: torch.Tensor, offset: int) -> str:
    """``name`` of a stage's GPTModel tensor as the whole model knows it: a layer's index counted from the whole
    model's first layer. A tied model's output layer is its embedding, one tensor: on the last of several stages
    megatron-core keeps a copy of it as the output layer's weight (marked ``shared``; the engine sums the two
    copies' gradients, so they stay equal), which goes by the embedding's name, so that conversions, checkpoint
    records and resharding see the one tensor whichever stage holds it."""
    if name == "output_layer.weight" and getattr(tensor, "shared", False):
        return TIED_EMBEDDING
    if not offset or not name.startswith("decoder.layers."):
        return name
    layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
    return f"decoder.layers.{int(layer) + offset}.{rest}"


def stage_names(hf_config: Any, lm_head: bool = True) -> set[str]:
    """The Megatron names (whole-model layer indices) of the tensors this pipeline stage holds: the embedding
    on the first stage, its contiguous slice of the layers, the final norm and output layer on the last (a
    tied model's output layer: its copy of the embedding, :func:`_whole_model_name`)."""
    layers = stage_layers(hf_config.num_hidden_layers)
    names = set()
    for tensor_map in _tensor_maps(hf_config, lm_head):
        name = tensor_map.megatron_name
        if name.startswith("decoder.layers."):
            held = int(name.split(".")[2]) in layers
        elif name.startswith("embedding."):
            held = parallel_state.is_pipeline_first_stage() or (
                hf_config.tie_word_embeddings and lm_head and parallel_state.is_pipeline_last_stage())
        else:
            held = parallel_state.is_pipeline_last_stage()
        if held:
            names.add(name)
    return names


def whole_shape(name: str, live: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor of which ``live`` is this rank's part."""
    rule = _split_rule(name, live)
    shape = list(live.shape)
    if rule is not None:
        dim, _, group = rule
        shape[dim] *= dist.get_world_size(group)
    return tuple(shape)


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
    return _part(whole, dim, parts, dist.get_rank(group), dist.get_world_size(group))


def _part(whole: torch.Tensor, dim: int, parts: int, rank: int, ranks: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``whole`` split among ``ranks`` on ``dim``: of each of its ``parts`` (a gated
    ``linear_fc1``'s gate and up), the rank's cut, joined (a new tensor, never a view of ``whole``)."""
    return torch.cat([part.chunk(ranks, dim)[rank] for part in whole.chunk(parts, dim)], dim)


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
    return _joined(pieces, dim, parts)


def _joined(pieces: Sequence[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The whole tensor from every rank's :func:`_part` of it, in rank order."""
    per_rank = [piece.chunk(parts, dim) for piece in pieces]  # each rank's [its gate; its up], or its one part
    return torch.cat([chunks[part] for part in range(parts) for chunks in per_rank], dim)


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf_state: Mapping[str, torch.Tensor], hf_config: Any) -> None:
    """Copy Hugging Face checkpoint tensors into ``model`` in place (optimizers holding its parameters stay valid);
    under tensor parallelism each rank takes its shard of the whole checkpoint, one tensor at a time. A value
    model's head (:class:`ValueHead`) is not in the checkpoint: it keeps its own weights, and the checkpoint's
    output layer is not read. A pipeline stage converts and takes only the tensors it holds."""
    live = model_tensors(model)
    lm_head = not isinstance(getattr(model, "output_layer", None), ValueHead)
    if not lm_head:
        live = {name: tensor for name, tensor in live.items() if not name.startswith("output_layer.")}
    names = stage_names(hf_config, lm_head)
    if names != set(live):
        raise ValueError(f"converted weights do not fit the model: missing {sorted(set(live) - names)[:5]},"
                         f" unknown {sorted(names - set(live))[:5]}")
    for name, tensor in _converted(hf_state, hf_config, lm_head, names):
        live[name].copy_(_shard(name, tensor, live[name]))


def hf_weights(model: GPTModel, hf_config: Any, device: str | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face checkpoint names: :func:`hf_tensors`, all of them."""
    return dict(hf_tensors(model, hf_config, device))


def hf_tensors(model: GPTModel, hf_config: Any, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under Hugging Face checkpoint names, detached (fused tensors are split into copies),
    whole, on ``device`` (None: the model's), one at a time: under tensor parallelism every rank must take them
    or call :func:`unsharded_weights` (under pipeline parallelism too: each rank gets every stage's tensors).
    Each tensor is gathered, converted and moved before the next, so on another device the model's own holds
    one whole tensor at a time."""
    maps = {tensor_map.megatron_name: tensor_map for tensor_map in _tensor_maps(hf_config)}
    for name, whole in unsharded_weights(model):
        yield from _split_to_hf(maps[name], whole, device)


def unsharded_weights(model: GPTModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of the model's tensors whole, by Megatron name, one gather at a time: a rank that only takes part
    in the gathers and drops each tensor holds one whole tensor at a time, not the whole model.

    Under pipeline parallelism every rank gets the tensors of every stage, stage after stage: each is
    gathered whole within its stage's tensor-parallel group, then broadcast from that stage over the pipeline
    group, so that rank 0 (the first stage) writes and publishes the whole model, and each rank can offer it
    on its own GPU as under tensor parallelism alone. A tensor that two stages hold (a tied model's embedding,
    the first stage's and the last's copy: equal) is gathered once, from the first."""
    mine = model_tensors(model)
    pipeline = parallel_state.get_pipeline_model_parallel_group()
    stages = dist.get_world_size(pipeline)
    if stages == 1:
        for name, tensor in mine.items():
            yield name, _unshard(name, tensor).detach()
        return
    # each stage's tensors: name, whole shape, dtype name, in its order
    held = gather_plain([(name, whole_shape(name, tensor), dtype_name(tensor.dtype))
                         for name, tensor in mine.items()], group=pipeline)
    stage = dist.get_rank(pipeline)
    gathered: set[str] = set()
    for owner, tensors in enumerate(held):
        source = dist.get_global_rank(pipeline, owner)
        for name, shape, dtype in tensors:
            if name in gathered:
                continue
            gathered.add(name)
            if owner == stage:
                whole = _unshard(name, mine[name]).detach().contiguous()
            else:
                whole = torch.empty(shape, dtype=dtype_named(dtype), device=next(iter(mine.values())).device)
            dist.broadcast(whole, src=source, group=pipeline)
            yield name, whole


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
