"""Lets megatron-core 0.19.2 run on a machine without CUDA -- for tests only.

megatron-core is a GPU library. On CPU it works except where it asks CUDA
which device to put a new tensor on (RoPE frequencies, router buffers, the
router weight, which it moves "to the GPU" on its first forward), and where
sequence parallelism forks the CUDA random state around the embedding and
every layer (for their dropout). The patches here answer the first with the
CPU and make the fork a no-op (dropout, where a config asks for it, then draws
from torch's default generator; the test models have none), so that the tests exercise
the very model, weight conversions, sequence parallelism and routing replay
that train on the GPU. They are applied only when CUDA is absent; a CPU run
is never a supported way to train with Megatron (a user without a GPU trains
with ``vime.backends.torch_train``).

The other CPU obstacles listed in ../shared/research/cpu-stack.md (section 3)
need no patch in the way ``vime.backends.megatron`` uses megatron-core:

- the default causal mask (``device="cuda"``) belongs to the local
  ``DotProductAttention``, which is replaced by an SDPA core attention;
- the CUDA RNG tracker is otherwise only consulted for dropout and activation
  recomputation, neither of which vime turns on, so it is never seeded;
- the ``alltoall`` MoE dispatcher (a ``torch.cuda.Stream``) is swapped for
  ``allgather`` in the model's config, and Megatron's optimizer
  (``device="cuda"``) for ``torch.optim.AdamW``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def apply() -> None:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"`` and the RNG tracker's fork do nothing when CUDA
    is absent; idempotent."""
    if not torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.current_device = _cpu_device
        get_cuda_rng_tracker().fork = _no_fork


def _cpu_device() -> str:
    return "cpu"


@contextlib.contextmanager
def _no_fork(name: str = "") -> Iterator[None]:
    yield
