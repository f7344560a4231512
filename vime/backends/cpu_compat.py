"""Lets megatron-core 0.19.2 run on a machine without CUDA -- for tests only.

megatron-core is a GPU library. On CPU it works except where it asks CUDA
which device to put a new tensor on (RoPE frequencies, router buffers, the
router weight, which it moves "to the GPU" on its first forward), where
sequence parallelism forks the CUDA random state around the embedding and
every layer (for their dropout), and where activation recomputation saves and
restores the CUDA random state around each recomputed layer. The patches here
answer the first with the CPU, make the fork a no-op (dropout, where a config
asks for it, then draws from torch's default generator; the test models have
none) and let recomputation save and restore the CPU's random state instead.
The ``alltoall`` MoE dispatcher copies its split sizes to the host on a
CUDA stream of its own; on CPU they are there already, and the patch hands
them to the collective (gloo) as the copy would. Pipeline parallelism's
point-to-point exchanges synchronise the CUDA device after each batch of
sends and receives (a no-op here: gloo's requests have completed when
waited on), and its schedules count tokens in a tensor made with
``device="cuda"``, which :func:`cuda_tensors_on_cpu` makes on the CPU
instead (and keeps there the tied embedding's copy that a last stage's
GPTModel moves with ``.cuda()``). So the tests exercise the very model, weight conversions,
sequence parallelism, token dispatch, recomputation, routing replay and
pipeline schedules that train on the GPU. The patches are
applied only when CUDA is absent; a CPU run is never a supported way to
train with Megatron (a user without a GPU trains with
``vime.backends.torch_train``).

The other CPU obstacles listed in ../shared/research/cpu-stack.md (section 3)
need no patch in the way ``vime.backends.megatron`` uses megatron-core:

- the default causal mask (``device="cuda"``) belongs to the local
  ``DotProductAttention``, which is replaced by an SDPA core attention;
- the CUDA RNG tracker's own states are otherwise only consulted for dropout
  (the test models have none) and saved and restored, empty, by
  recomputation, so it is never seeded on CPU;
- Megatron's optimizer (``device="cuda"``) is not used: vime trains with
  ``torch.optim.AdamW``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def apply() -> None:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"``, ``torch.cuda.synchronize()`` do nothing, the RNG
    tracker's fork do nothing, recomputation keep the CPU's random state and the alltoall dispatcher skip its
    copy to the host when CUDA is absent; idempotent."""
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel import random

        torch.cuda.current_device = _cpu_device
        torch.cuda.synchronize = _nothing
        random.get_cuda_rng_tracker().fork = _no_fork
        random._get_cuda_rng_state = _cpu_rng_state
        random._set_cuda_rng_state = _set_cpu_rng_state
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # set: the first dispatcher makes no CUDA stream
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _on_the_host


def _cpu_device() -> str:
    return "cpu"


def _nothing(*args: object, **kwargs: object) -> None:
    return None


class _CudaTensorsOnCpu(TorchFunctionMode):
    """Tensors asked for on ``device="cuda"`` are made on the CPU; a tensor moved there (``.cuda()``) stays."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = kwargs or {}
        if kwargs.get("device") == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def cuda_tensors_on_cpu() -> contextlib.AbstractContextManager:
    """Around a call into megatron-core's pipeline schedules, which make a tensor with ``device="cuda"``, or into
    a tied model's last pipeline stage's constructor, which moves its copy of the embedding to the GPU (to
    start it from the first stage's): on a machine without CUDA, such tensors are made, or stay, on the CPU;
    with CUDA, nothing changes."""
    return contextlib.nullcontext() if torch.cuda.is_available() else _CudaTensorsOnCpu()


@contextlib.contextmanager
def _no_fork(name: str = "") -> Iterator[None]:
    yield


def _cpu_rng_state(*args: object, **kwargs: object) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *args: object, **kwargs: object) -> None:
    torch.set_rng_state(state)


def _on_the_host(dispatcher: object, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """The alltoall dispatcher's copy to the host, with nothing to copy: its split sizes become the numpy
    arrays that the collective takes, as the copy makes them on a GPU."""
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(dispatcher, name, None)
        if torch.is_tensor(value):
            setattr(dispatcher, name, value.numpy())
    return tokens_per_expert
