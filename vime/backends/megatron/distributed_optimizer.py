"""The distributed optimizer (``--use-distributed-optimizer``): AdamW's state sharded over the data-parallel
ranks, ZeRO-1 style, as megatron-core's ``DistributedOptimizer`` shards it.

Every data-parallel copy of a tensor holds the same weights and, once the engine has summed them over the copies,
the same gradient; without this each copy also holds the same Adam moments and takes the same step. Here each
copy keeps the moments of only its part of every tensor and steps that part; after the step the parts are
gathered back, so that every copy holds the whole updated tensor again. AdamW is elementwise, so the parts' steps
are exactly the whole step: the distributed optimizer trains as the plain one does.

How it matches megatron-core, and where it departs:

- Sharding per tensor, not over one flattened buffer. megatron-core's ``DistributedOptimizer`` divides a
  contiguous buffer of all the gradients evenly among the ranks; that buffer is its ``DistributedDataParallel``
  wrapper's, which vime's models do not have (their parameters are separate tensors, the engine sums their
  gradients in buckets of its own, ``parallel._sum_over``). Here each tensor, flattened, is cut into as many
  equal parts as there are copies (the last one shorter): each rank holds ``1 / copies`` of the state give or
  take fewer than ``copies`` elements per tensor, as megatron-core's even split does, and the parts gather
  bucket by bucket into the tensors themselves, never through a second whole copy of the weights.
- Gradients are all-reduced, then each rank reads its part, instead of reduce-scattered. The engine's clipping
  (``MegatronTrainEngine._clip_gradients``) takes the global norm from whole gradients, counting tensor- and
  expert-parallel shards once and duplicates once; with whole gradients on every rank that norm is unchanged
  and equals the plain optimizer's exactly, with no second norm computation to keep in step. The price is
  bandwidth: an all-reduce moves about twice a reduce-scatter's bytes. The gradients' memory is the same either
  way (megatron-core also keeps a whole gradient buffer on every rank).
- A tensor is divided among the ranks that hold copies of it: the data-parallel group for the dense tensors, the
  expert-data-parallel group for the experts (one rank when the copies divide the experts among themselves),
  which is megatron-core's split of its expert buffers.
- What is sharded is the Adam moments (and step counts) and, in bf16, the fp32 masters. In fp32 the masters are
  the parameters themselves, which the forward needs whole: each rank's part is a view of the whole tensor, so
  the step writes the rank's part in place and the gather fills in the others. In bf16
  (:class:`ShardedMasterWeights`) each rank keeps the fp32 master of its part only; the fp32 gradient still
  accumulates whole, as ``vime.backends.master_weights`` accumulates it (megatron-core's gradient buffer is whole
  too), on a stand-in of the master's shape that holds no values, so that clipping sees the gradients it saw
  before. After the step each rank rounds its part into its part of the bf16 parameter and the bf16 parts are
  gathered: per parameter a rank holds 2 bytes of weights, 4 of gradient and 12 / copies of masters and moments,
  megatron-core's figures.

The optimizer the engine and its scheduler see (:class:`ShardedAdamW`) has the whole tensors (in bf16 the
masters' stand-ins) as its parameter groups, so zeroing, clipping and the learning-rate schedule act on them as
before. Its ``state_dict`` and the masters' are the rank's parts: each rank saves its own, and a resume must be
in the same layout (the engine refuses another, naming the flag).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from vime.backends.master_weights import MasterWeights


class Part:
    """A whole tensor and the part of it, flattened, that this rank steps: ``size`` elements per rank (the
    last rank's part may be shorter or empty). ``view`` is what the optimizer steps, a view sharing the
    tensor's memory, and ``holder`` the tensor whose ``.grad`` is the whole (summed) gradient, the tensor
    itself; :class:`ShardedMasterWeights` makes them an fp32 master of the part and a stand-in."""

    def __init__(self, whole: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.whole, self.holder, self.group = whole, whole, group
        ranks = dist.get_world_size(group)
        self.size = -(-whole.numel() // ranks)
        start = min(dist.get_rank(group) * self.size, whole.numel())
        self.span = slice(start, min(start + self.size, whole.numel()))
        self.view = self.own()

    def own(self) -> torch.Tensor:
        """This rank's part of the whole tensor, a view sharing its memory."""
        return self.whole.detach().view(-1)[self.span]

    def in_place(self) -> bool:
        """Whether the step writes the whole tensor's part itself (not a master of it)."""
        return self.holder is self.whole

    def take_gradient(self) -> None:
        """The view's gradient: its part of the whole (summed) gradient, or none where the whole has none."""
        grad = self.holder.grad
        self.view.grad = None if grad is None else grad.view(-1)[self.span]


class ShardedMasterWeights(MasterWeights):
    """fp32 masters of this rank's part of every parameter (``group_of(param)``: the process group of the ranks
    that hold copies of ``param``, among which it is divided), which :class:`ShardedAdamW` steps; :attr:`groups`
    are stand-ins of the parameters' shapes that hold no values, only the whole fp32 gradient (``.grad``)."""

    def __init__(self, modules: Iterable[torch.nn.Module], group_of: Callable[[torch.Tensor], dist.ProcessGroup],
                 bucket_bytes: int = 64 << 20) -> None:
        self._group_of, self._bucket_bytes = group_of, bucket_bytes
        self._parts: dict[int, Part] = {}  # by the stand-in's id, which the optimizer's groups hold
        super().__init__(modules)

    def _master(self, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
        part = Part(param, self._group_of(param))
        part.view = part.own().to(torch.float32, copy=True)  # a copy: the fp32 parameter is freed once bf16
        part.holder = torch.zeros((), dtype=torch.float32, device=param.device).expand(param.shape)  # 4 bytes
        self._parts[id(part.holder)] = part
        return part.view, part.holder

    def part_of(self, holder: torch.Tensor) -> Part:
        """The part whose gradient ``holder`` (one of :attr:`groups`) carries."""
        return self._parts[id(holder)]

    @torch.no_grad()
    def publish(self) -> None:
        """Every rank rounds its masters into its part of each bf16 parameter and the parts are gathered (a
        collective: every rank calls this, after each optimizer step and after a load)."""
        parts = list(self._parts.values())
        torch._foreach_copy_([part.own() for part in parts], [part.view for part in parts])
        for bucket in _buckets(parts, self._bucket_bytes):
            _gather(bucket)


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over ``groups`` (parameter groups of whole tensors, as ``torch.optim.AdamW`` takes them) whose state
    each rank keeps for its part of every tensor only; ``part_of(tensor)`` is that part (a :class:`Part` divided
    among the ranks that hold copies of ``tensor``, or :meth:`ShardedMasterWeights.part_of`). ``step`` steps the
    parts, then gathers those that are the tensors' own back into the whole tensors (a master's part is gathered
    by its masters' ``publish``): every rank of a group must call it. ``adamw``: ``torch.optim.AdamW``'s keywords
    other than the learning rate, which each group of ``groups`` gives."""

    def __init__(self, groups: list[dict[str, Any]], part_of: Callable[[torch.Tensor], Part],
                 bucket_bytes: int = 64 << 20, **adamw: Any) -> None:
        super().__init__(groups, {})  # every group has its lr: the policy's, the value model's
        self._parts = [[part_of(tensor) for tensor in group["params"]] for group in self.param_groups]
        self._bucket_bytes = bucket_bytes
        self._inner = torch.optim.AdamW([{"params": [part.view for part in parts], "lr": group["lr"]}
                                         for parts, group in zip(self._parts, self.param_groups, strict=True)],
                                        **adamw)
        self.state = self._inner.state  # what the state is: the parts' moments and step counts

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One AdamW step of this rank's parts at the groups' learning rates (set by the schedule on the whole
        tensors' groups), then every in-place part gathered into its tensor on every rank (the masters' parts
        are rounded and gathered by :meth:`ShardedMasterWeights.publish`, which the trainer calls next)."""
        _copy_lr(self.param_groups, self._inner.param_groups)
        parts = [part for group in self._parts for part in group]
        for part in parts:
            part.take_gradient()
        self._inner.step()
        for part in parts:
            part.view.grad = None  # a view of the whole gradient: the next zero_grad frees that
        for bucket in _buckets([part for part in parts if part.in_place()], self._bucket_bytes):
            _gather(bucket)

    def state_dict(self) -> dict[str, Any]:
        """This rank's parts' state, with the groups' current learning rates."""
        _copy_lr(self.param_groups, self._inner.param_groups)
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A state :meth:`state_dict` gave on the rank of this layout that holds these parts."""
        self._inner.load_state_dict(state_dict)
        self.state = self._inner.state
        _copy_lr(self._inner.param_groups, self.param_groups)


def _copy_lr(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    for given, taken in zip(source, target, strict=True):
        taken["lr"] = given["lr"]


def _buckets(parts: list[Part], bucket_bytes: int) -> Iterator[list[Part]]:
    """``parts`` in runs of one process group and dtype, each of about ``bucket_bytes`` per rank at most (a
    larger part alone): one gather each."""
    bucket: list[Part] = []
    size = 0
    for part in parts:
        if bucket and (size >= bucket_bytes or part.group is not bucket[0].group
                       or part.whole.dtype != bucket[0].whole.dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(part)
        size += part.size * part.whole.element_size()
    if bucket:
        yield bucket


def _gather(bucket: list[Part]) -> None:
    """Every rank's parts of ``bucket``'s whole tensors into those tensors (a collective of the bucket's group):
    each rank sends its parts, each padded to its tensor's part size, in one flat tensor."""
    group = bucket[0].group
    ranks = dist.get_world_size(group)
    if ranks == 1:
        return
    mine = torch.zeros(sum(part.size for part in bucket), dtype=bucket[0].whole.dtype, device=bucket[0].whole.device)
    offsets = []
    offset = 0
    for part in bucket:
        mine[offset:offset + part.view.numel()] = part.own()
        offsets.append(offset)
        offset += part.size
    pieces = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(pieces, mine, group=group)
    for part, offset in zip(bucket, offsets):
        joined = torch.cat([piece[offset:offset + part.size] for piece in pieces])
        part.whole.view(-1).copy_(joined[:part.whole.numel()])


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer``'s state on this rank (Adam's moments and step counts)."""
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


def master_bytes(masters: MasterWeights | None) -> int:
    """Bytes of the fp32 masters on this rank (none in fp32 training, where the parameters are the masters)."""
    return 0 if masters is None else sum(master.numel() * master.element_size() for master in masters.state_dict())
