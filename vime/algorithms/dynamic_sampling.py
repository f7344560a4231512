"""Dynamic sampling (DAPO): train only on groups whose rewards differ.

A group whose rewards are all equal has zero group-normalised advantage for
every sample, so it adds no gradient, only noise in the batch size. The
buffer drops such groups and draws replacement prompts from the source.
"""

from __future__ import annotations

from typing import Sequence


def is_informative(rewards: Sequence[float], tolerance: float = 1e-9) -> bool:
    """True when the group's rewards are not all equal (within ``tolerance``)."""
    return len(rewards) > 0 and max(rewards) - min(rewards) > tolerance
