"""Lets megatron-core 0.19.2 run on a machine without CUDA -- for tests only.

megatron-core is a GPU library. On CPU it works except where it asks CUDA
which device to put a new tensor on (RoPE frequencies, router buffers, the
router weight, which it moves "to the GPU" on its first forward). The patch
here answers that question with the CPU, so that the tests exercise the very
model, weight conversions and routing replay that train on the GPU. It is
applied only when CUDA is absent; a CPU run is never a supported way to train
with Megatron (a user without a GPU trains with ``vime.backends.torch_train``).

The other CPU obstacles listed in ../shared/research/cpu-stack.md (section 3)
need no patch in the way ``vime.backends.megatron`` uses megatron-core:

- the default causal mask (``device="cuda"``) belongs to the local
  ``DotProductAttention``, which is replaced by an SDPA core attention;
- the CUDA RNG tracker is only consulted for dropout, sequence parallelism and
  activation recomputation, none of which a CPU test turns on (all three model
  families train without dropout), so the tracker is never seeded;
- the ``alltoall`` MoE dispatcher (a ``torch.cuda.Stream``) is swapped for
  ``allgather`` in the model's config, and Megatron's optimizer
  (``device="cuda"``) for ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch


def apply() -> None:
    """Make ``torch.cuda.current_device()`` answer ``"cpu"`` when CUDA is absent; idempotent."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_device


def _cpu_device() -> str:
    return "cpu"
