"""Checkpoints that reshard: the trainer state that ranks of one layout (tensor, data and expert parallel sizes)
saved, read back by the ranks of another.

Each rank saves its own trainer state, one file per rank (the optimizer's state, the fp32 masters, the value
model's weights: its shard of each tensor), and beside it a record of every tensor of the models it trains: the
tensor's whole shape and which part of it the rank holds (:func:`shard_records`). A trainer of the same layout
reads its own file back as it is. One of another layout opens every rank's file (memory-mapped: it holds the
parts of one tensor at a time, not every rank's state), joins each tensor from its parts as the gathers of
``weights`` join them, and keeps its own part (:func:`resharded_state`). Adam's moments and the masters are
elementwise companions of their parameter, so they divide as it does; Adam's step count and the schedule are the
same on every rank. The policy's weights come from the checkpoint's Hugging Face folder, which any layout reads.

Not megatron-core's dist-checkpointing: it describes a model and a MegatronOptimizer as ShardedTensors through
their ``sharded_state_dict``, and this trainer steps torch's AdamW over its own masters
(``vime.backends.master_weights``), with layers of its own (``GroupedExperts``, whose split weights
megatron-core's default ``sharded_state_dict`` would take for replicated ones). It would need the same
description of every tensor that :func:`shard_records` is, in its format, and one checkpoint format in place of
today's per-rank files. Here the split rules stay in one place, ``weights._split_rule``, which loading a Hugging
Face folder and gathering the weights use too, and a resume in the same layout reads its own file as before.

Refused, saying what to do: a state saved for another model or value model (a tensor's name or whole shape
differs), for another algorithm (with a value model or without), by another train backend, by vime before these
records, or with a rank's file missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel

from vime.backends.megatron.weights import _joined, _shard, _split_rule, model_tensors, whole_shape

Split = tuple[int, int, int, int]  # (dim, parts, rank, ranks): the rank's part, as ``weights._part`` cuts it
Record = tuple[tuple[int, ...], Split | None]  # a tensor's whole shape, and the part a rank holds (None: whole)
ROLES = ("policy", "value model")  # the trained models, in the optimizer's order of parameter groups


def shard_records(model: GPTModel) -> dict[str, Record]:
    """Every tensor of ``model`` by Megatron name: its whole shape, and the part of it this rank holds."""
    records: dict[str, Record] = {}
    for name, live in model_tensors(model).items():
        rule = _split_rule(name, live)
        if rule is None:
            records[name] = (tuple(live.shape), None)
            continue
        dim, parts, group = rule
        records[name] = (whole_shape(name, live), (dim, parts, dist.get_rank(group), dist.get_world_size(group)))
    return records


def trained_names(model: GPTModel) -> list[str]:
    """The Megatron names of ``model``'s trained parameters, in the order the optimizer holds them."""
    return [name for name, param in model.named_parameters() if param.requires_grad]


def check_models(saved: dict[str, Any], models: Sequence[GPTModel], folder: Path) -> None:
    """Refuse a trainer state that :meth:`MegatronTrainEngine.save` wrote for other models than ``models`` (the
    policy and, for ppo, the value model): another model, or another algorithm. One written before the records
    were kept passes (same-layout resumes of it went unchecked before, and still do)."""
    if "shards" not in saved:
        return
    written = saved["shards"]
    if len(written) != len(models):
        had, has = ("a", "no") if len(written) > len(models) else ("no", "a")
        raise ValueError(f"{folder} was saved by a trainer with {had} value model and this one has {has} value "
                         "model: resume with the --algo that run had (ppo trains one)")
    for role, records, model in zip(ROLES, written, models):
        mine = {name: shape for name, (shape, _) in shard_records(model).items()}
        theirs = {name: shape for name, (shape, _) in records.items()}
        if mine != theirs:
            name = next(name for name in sorted(mine.keys() | theirs.keys()) if mine.get(name) != theirs.get(name))
            raise ValueError(f"{folder} holds the trainer state of another {role}: its {name} is "
                             f"{_shape(theirs.get(name))} there and {_shape(mine.get(name))} here; resume with the "
                             "--model-path (for ppo, and --critic-model-path) that run was started with")


def resharded_state(states: Sequence[dict[str, Any]], trained: Sequence[torch.nn.Module],
                    folder: Path) -> dict[str, Any]:
    """This rank's trainer state, as ``TorchTrainEngine._trainer_state`` gives it, from ``states``: every rank's
    state of the checkpoint in ``folder``, saved in another layout. ``trained``: the models this rank trains (the
    policy and, for ppo, the value model, each holding its GPTModel as ``model``) in this rank's layout."""
    first = states[0]
    if any("shards" not in state for state in states):
        raise ValueError(f"{folder} was saved by vime before its checkpoints recorded each rank's shards: resume it "
                         f"with the layout it was written in, {first['layout']}")
    models = [module.model for module in trained]
    check_models(first, models, folder)
    saved_order = [(role, name) for role, names in enumerate(first["parameters"]) for name in names]
    index = {slot: at for at, slot in enumerate(saved_order)}  # where the saved optimizer and masters hold each
    params = [dict(model.named_parameters()) for model in models]
    rejoin = _Rejoin(states, folder)
    optimizer = {"state": {}, "param_groups": first["optimizer"]["param_groups"]}
    masters = None if first["masters"] is None else []
    slots = [(role, name, params[role][name]) for role, model in enumerate(models) for name in trained_names(model)]
    for slot, (role, name, live) in enumerate(slots):
        at = index[role, name]
        if masters is not None:
            masters.append(rejoin(role, name, live, lambda state: state["masters"][at]))
        held = first["optimizer"]["state"].get(at)
        if held is not None:  # AdamW keeps state for the parameters that had a gradient
            optimizer["state"][slot] = {
                key: rejoin(role, name, live, lambda state, key=key: state["optimizer"]["state"][at][key])
                if value.dim() else value  # the step count, the same for all; the moments, elementwise
                for key, value in held.items()}
    critic = None
    if len(trained) > 1:  # the value model's weights, role 1 (ROLES), by the names its wrapper gives them
        critic = {key: rejoin(1, key.removeprefix("model."), value, lambda state, key=key: state["critic"][key])
                  if isinstance(value, torch.Tensor) else value
                  for key, value in trained[1].state_dict(keep_vars=True).items()}
    return {**first, "optimizer": optimizer, "masters": masters, "critic": critic}


class _Rejoin:
    """A rank's part of each tensor, joined whole from the parts the saved ranks held and cut again."""

    def __init__(self, states: Sequence[dict[str, Any]], folder: Path) -> None:
        self.states, self.folder = states, folder

    def __call__(self, role: int, name: str, live: torch.Tensor,
                 read: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor:
        """This rank's part of tensor ``name`` of model ``role`` (``live``: as this rank holds it), from the part
        that ``read`` finds in each saved rank's state; a new tensor, not a view of a memory-mapped file."""
        _, split = self.states[0]["shards"][role][name]
        if split is None:
            return _shard(name, read(self.states[0]).clone(), live)
        dim, parts, _, ranks = split
        holders = {state["shards"][role][name][1][2]: state for state in self.states}  # copies hold the same part
        missing = sorted(set(range(ranks)) - set(holders))
        if missing:
            raise ValueError(f"{self.folder} lacks the trainer state of the rank that held part {missing[0]} of "
                             f"{ranks} of {name}: the checkpoint is incomplete; resume from an earlier one")
        return _shard(name, _joined([read(holders[rank]) for rank in range(ranks)], dim, parts), live)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))
