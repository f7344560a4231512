"""A record of the places a CPU run would make the host wait for a GPU: :class:`DeviceReads`.

On a GPU, reading a tensor's values on the host (``.item()``, ``int()``, ``.tolist()``, ``.cpu()``, a device tensor
as a slice bound: ``x[rows, :width]``), an op whose output size depends on the values (``nonzero``,
``repeat_interleave`` by a tensor without ``output_size``), or a blocking copy of a host tensor to the device
(``.to(device)``, or a host index tensor indexing a device tensor, which torch copies over for you) stalls the host
until the work queued before it has run. A CPU run cannot see that: every tensor is on the host. This mode tells the
two apart by provenance instead: the tensors that would live on the device are marked (a model's parameters and
buffers, and whatever ``.to(device)`` copies over), so is every tensor a torch call computes from a marked one, and
each of those events on a marked tensor is recorded, with the line of code outside torch that caused it.

Not seen, so a passing test does not rule them out:

- ``.to("cpu")`` of a marked tensor, taken to stay on the device (on the CPU the device's name is the host's):
  only ``.cpu()`` and the value reads above count as copies back;
- ops with a value-dependent size or a read that the sets below leave out: ``torch.where`` with one argument,
  ``bincount``, ``allclose``, among others;
- formatting a tensor (an f-string, ``repr``), which reads its values inside torch;
- reads inside torch functions written in Python: the mode sees the outer call, not the reads it makes;
- host and device tensors mixed in arithmetic (a host scalar tensor is copied over by torch, a GPU would refuse
  others): nothing records which side a host operand came from;
- ops run by autograd's engine (the backward pass outside custom functions).
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree
from torch.utils.weak import WeakIdKeyDictionary

# the value of a device tensor read on the host
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__,
              torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}
# an output as large as the values say: the host must learn them to allocate it
SIZED_BY_VALUES = {torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
                   torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
                   torch.equal, torch.Tensor.equal}
# an output as large as the repeats add up to, unless ``output_size`` says so
REPEATS = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.index_select, torch.Tensor.index_select,
            torch.Tensor.index_put_, torch.Tensor.index_put, torch.gather, torch.Tensor.gather}
_TORCH = str(Path(torch.__file__).parent)


class DeviceReads(TorchFunctionMode):
    """Within it, ``reads`` lists each event that would make the host wait for a GPU (see the module's docstring),
    as ``"<what> at <file>:<line>"``; ``on_device`` are the tensors that start on the device."""

    def __init__(self, on_device: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in on_device:
            self.device[tensor] = True
        self.reads: list[str] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [leaf for leaf in _pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        marked = any(tensor in self.device for tensor in tensors)
        out = func(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._copied(args, kwargs, out, marked)
        if marked and func in HOST_READS:
            self._record(f"{func.__name__} of a device tensor")
            return out.clone() if out is args[0] else out  # a host copy, no longer marked
        if marked and (func in SIZED_BY_VALUES or _bool_mask(func, args)):
            self._record(f"{func.__name__} (its size depends on the device's values)")
        if marked and func in INDEXING and any(tensor not in self.device and tensor.dim() for tensor in tensors):
            self._record(f"{func.__name__} of a device tensor by a host tensor (copied over, blocking)")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and any(
                bound in self.device for bound in _slice_bounds(args[1])):
            self._record(f"{func.__name__} with a device tensor as a slice bound (its value read on the host)")
        if marked and func in REPEATS and _repeats_by_tensor(args, kwargs) and kwargs.get("output_size") is None:
            self._record(f"{func.__name__} by a tensor without output_size (its size depends on the device's values)")
        if marked or "device" in kwargs:  # computed on the device, or made there
            for leaf in _pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.device[leaf] = True
        return out

    def _copied(self, args: tuple, kwargs: dict, out: Any, marked: bool) -> Any:
        """``tensor.to(...)``: a host tensor sent to a named device (taken to be the device: a CPU run's device is
        named as its host is) is copied over, blocking unless ``non_blocking``, and the copy is marked; a marked
        tensor stays on the device."""
        named = "device" in kwargs or any(isinstance(arg, (str, torch.device, torch.Tensor)) for arg in args[1:])
        if marked:
            self.device[out] = True
        if marked or not named:
            return out
        if not kwargs.get("non_blocking", False):
            self._record("to(device) of a host tensor (blocking)")
        copy = out.clone() if out is args[0] else out
        self.device[copy] = True
        return copy

    def _record(self, what: str) -> None:
        frame = next(frame for frame in reversed(traceback.extract_stack()[:-2])
                     if not frame.filename.startswith(_TORCH) and frame.filename != __file__)
        self.reads.append(f"{what} at {Path(frame.filename).name}:{frame.lineno}")

    def counts(self) -> collections.Counter:
        """How often each read happened."""
        return collections.Counter(self.reads)


def _bool_mask(func: Callable, args: tuple) -> bool:
    """Indexing by a boolean mask: as many elements as it holds True."""
    if func not in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in index)



def _slice_bounds(index: Any) -> list[torch.Tensor]:
    """The tensors among the start, stop and step of the slices in ``index`` (one index, or a tuple of them):
    Python reads each one's value to slice, which torch's pytree does not look inside."""
    parts = index if isinstance(index, tuple) else (index,)
    return [bound for part in parts if isinstance(part, slice) for bound in (part.start, part.stop, part.step)
            if isinstance(bound, torch.Tensor)]


def _repeats_by_tensor(args: tuple, kwargs: dict) -> bool:
    """Whether ``repeat_interleave`` repeats by a tensor (``repeat_interleave(repeats)``, or ``repeats`` a tensor),
    not by an int, whose output size the host knows."""
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    return repeats is None or isinstance(repeats, torch.Tensor)
