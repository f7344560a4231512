"""Checkpoints that reshard: the trainer state that ranks of one layout (tensor, data, expert parallel sizes and
pipeline stages) saved, read back by the ranks of another.

Each rank saves its own trainer state, one file per rank (the optimizer's state, the fp32 masters, the value
model's weights: its shard of each tensor), and beside it a record of every tensor of the models it trains: the
tensor's whole shape and which part of it the rank holds (:func:`shard_records`). A trainer of the same layout
reads its own file back as it is. One of another layout opens every rank's file (memory-mapped: it holds the
parts of one tensor at a time, not every rank's state), joins each tensor from its parts as the gathers of
``weights`` join them, and keeps its own part (:func:`resharded_state`). Adam's moments and the masters are
elementwise companions of their parameter, so they divide as it does; Adam's step count and the schedule are the
same on every rank. Tensors are recorded by their names in the whole model (a stage's layers by their place in
it), so a rank of one pipeline stage finds its layers among the files of whichever stages held them, and its
optimizer's parameter groups are rebuilt for the parameters it holds. The policy's weights come from the
checkpoint's Hugging Face folder, which any layout reads.

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

from vime.backends.megatron.weights import (
    _joined,
    _shard,
    _split_rule,
    model_tensors,
    named_parameters,
    whole_model_names,
    whole_shape,
)

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
    """The names (whole-model layer indices) of ``model``'s trained parameters, in the order the optimizer holds
    them."""
    return [name for name, param in named_parameters(model).items() if param.requires_grad]


Shapes = dict[str, tuple[int, ...]]  # every tensor of a model (or of the part a pipeline stage holds): whole shape


def model_shapes(models: Sequence[GPTModel]) -> list[Shapes]:
    """The whole shape of every tensor of each of ``models`` (the policy and, for ppo, the value model) that this
    rank holds a part of."""
    return [{name: shape for name, (shape, _) in shard_records(model).items()} for model in models]


def saved_shapes(states: Sequence[dict[str, Any]]) -> list[Shapes]:
    """What :func:`model_shapes` gave the ranks that saved ``states``, joined: the whole models when every
    stage's file is among them."""
    joined: list[Shapes] = [{} for _ in states[0]["shards"]]
    for state in states:
        for role, records in enumerate(state["shards"]):
            joined[role].update({name: shape for name, (shape, _) in records.items()})
    return joined


def check_models(saved: Sequence[Shapes], models: Sequence[Shapes], folder: Path) -> None:
    """Refuse a trainer state whose models (``saved``: :func:`saved_shapes`) are not ``models``
    (:func:`model_shapes`, joined over this trainer's pipeline stages when it reshards): another model, another
    algorithm, or a checkpoint missing the files of a stage."""
    if len(saved) != len(models):
        had, has = ("a", "no") if len(saved) > len(models) else ("no", "a")
        raise ValueError(f"{folder} was saved by a trainer with {had} value model and this one has {has} value "
                         "model: resume with the --algo that run had (ppo trains one)")
    for role, theirs, mine in zip(ROLES, saved, models):
        if mine == theirs:
            continue
        name = next(name for name in sorted(mine.keys() | theirs.keys()) if mine.get(name) != theirs.get(name))
        if theirs.items() < mine.items():
            raise ValueError(f"{folder} lacks the trainer state of the ranks that held {name}: the checkpoint is "
                             "incomplete (a pipeline stage's files are missing); resume from an earlier one")
        raise ValueError(f"{folder} holds the trainer state of another {role}: its {name} is "
                         f"{_shape(theirs.get(name))} there and {_shape(mine.get(name))} here; resume with the "
                         "--model-path (for ppo, and --critic-model-path) that run was started with")


def resharded_state(states: Sequence[dict[str, Any]], trained: Sequence[torch.nn.Module], folder: Path,
                    whole: Sequence[Shapes] | None = None) -> dict[str, Any]:
    """This rank's trainer state, as ``TorchTrainEngine._trainer_state`` gives it, from ``states``: every rank's
    state of the checkpoint in ``folder``, saved in another layout. ``trained``: the models this rank trains (the
    policy and, for ppo, the value model, each holding its GPTModel as ``model``) in this rank's layout;
    ``whole``: their :func:`model_shapes` joined over this trainer's pipeline stages (default: this rank's, a
    trainer without stages). Each parameter's optimizer state and master come from the saved ranks that held
    it, whatever their stages; the parameter groups are rebuilt for this rank's parameters."""
    first = states[0]
    if any("shards" not in state for state in states):
        raise ValueError(f"{folder} was saved by vime before its checkpoints recorded each rank's shards: resume it "
                         f"with the layout it was written in, {first['layout']}")
    models = [module.model for module in trained]
    check_models(saved_shapes(states), whole or model_shapes(models), folder)
    rejoin = _Rejoin(states, folder)
    optimizer: dict[str, Any] = {"state": {}, "param_groups": []}
    masters = None if first["masters"] is None else []
    for role, model in enumerate(models):
        group = {**first["optimizer"]["param_groups"][role], "params": []}
        optimizer["param_groups"].append(group)
        params = named_parameters(model)
        for name in trained_names(model):
            slot, live = sum(len(group["params"]) for group in optimizer["param_groups"]), params[name]
            group["params"].append(slot)
            if masters is not None:
                masters.append(rejoin(role, name, live, lambda state, at: state["masters"][at]))
            held = rejoin.optimizer_state(role, name)
            if held is not None:  # AdamW keeps state for the parameters that had a gradient
                optimizer["state"][slot] = {
                    key: rejoin(role, name, live, lambda state, at, key=key: state["optimizer"]["state"][at][key])
                    if value.dim() else value  # the step count, the same for all; the moments, elementwise
                    for key, value in held.items()}
    critic = None
    if len(trained) > 1:  # the value model's weights, role 1 (ROLES), saved by the whole model's names
        saved = saved_critic_names(models[1])
        critic = {key: rejoin(1, saved[key].removeprefix("model."), value,
                              lambda state, _, name=saved[key]: state["critic"][name])
                  if isinstance(value, torch.Tensor) else value
                  for key, value in trained[1].state_dict(keep_vars=True).items()}
    return {**first, "optimizer": optimizer, "masters": masters, "critic": critic}


def saved_critic_names(model: GPTModel) -> dict[str, str]:
    """The names of PPO's value model's state (its wrapper's, ``model.`` and this pipeline stage's own layer
    numbers, around the GPTModel ``model``) -> those a checkpoint keeps it by: the whole model's
    (:func:`whole_model_names`), so that a trainer of other stages finds its own entries among any rank's. The two
    are the same without stages, as in every checkpoint saved before the value model could be split."""
    return {f"model.{name}": f"model.{whole}" for name, whole in whole_model_names(model).items()}


class _Rejoin:
    """A rank's part of each tensor, joined whole from the parts the saved ranks held and cut again: the saved
    ranks that held a part of it (of any stage), and where each kept its optimizer state."""

    def __init__(self, states: Sequence[dict[str, Any]], folder: Path) -> None:
        self.states, self.folder = states, folder
        self.slots = [_slots(state, folder) for state in states]
        self.holding: dict[tuple[int, str], list[int]] = {}  # the saved states holding a part of each tensor
        for at, state in enumerate(states):
            for role, records in enumerate(state["shards"]):
                for name in records:
                    self.holding.setdefault((role, name), []).append(at)

    def optimizer_state(self, role: int, name: str) -> dict[str, Any] | None:
        """AdamW's state of parameter ``name`` as a saved rank holding it kept it (None: it had no gradient)."""
        at = self.holding[role, name][0]
        return self.states[at]["optimizer"]["state"].get(self.slots[at][role, name])

    def __call__(self, role: int, name: str, live: torch.Tensor,
                 read: Callable[[dict[str, Any], int | None], torch.Tensor]) -> torch.Tensor:
        """This rank's part of tensor ``name`` of model ``role`` (``live``: as this rank holds it), from the part
        that ``read`` finds in each saved rank's state (given its state and the parameter's place in that
        state's optimizer); a new tensor, not a view of a memory-mapped file."""
        holding = self.holding[role, name]
        _, split = self.states[holding[0]]["shards"][role][name]
        if split is None:
            return _shard(name, self._read(holding[0], role, name, read).clone(), live)
        dim, parts, _, ranks = split
        holders = {self.states[at]["shards"][role][name][1][2]: at for at in holding}  # copies hold the same part
        missing = sorted(set(range(ranks)) - set(holders))
        if missing:
            raise ValueError(f"{self.folder} lacks the trainer state of the rank that held part {missing[0]} of "
                             f"{ranks} of {name}: the checkpoint is incomplete; resume from an earlier one")
        pieces = [self._read(holders[rank], role, name, read) for rank in range(ranks)]
        return _shard(name, _joined(pieces, dim, parts), live)

    def _read(self, at: int, role: int, name: str,
              read: Callable[[dict[str, Any], int | None], torch.Tensor]) -> torch.Tensor:
        return read(self.states[at], self.slots[at].get((role, name)))


def _slots(state: dict[str, Any], folder: Path) -> dict[tuple[int, str], int]:
    """Where ``state``'s optimizer and masters hold each trained parameter, by (model, whole-model name)."""
    order = [(role, name) for role, names in enumerate(state["parameters"]) for name in names]
    unrecorded = next(((role, name) for role, name in order if name not in state["shards"][role]), None)
    if unrecorded is not None:
        raise ValueError(f"{folder} names its parameter {unrecorded[1]} by its pipeline stage's own layer numbers "
                         f"(vime before checkpoints named layers by their place in the whole model): resume it "
                         f"with the layout it was written in, {state['layout']}")
    return {slot: at for at, slot in enumerate(order)}


def _shape(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))
