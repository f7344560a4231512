"""vime: RL post-training for LLMs on lightweight nng actors.

The public runtime surface is re-exported here; implementations live in the
modules named for what they are (runtime, cluster, messages, transports).
The re-exports are resolved on first use, so that importing one light module
(``vime.rewards`` in a reward worker, ``vime.config``) does not import the
runtime, and with it torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Actor": "vime.runtime",
    "ActorEvent": "vime.cluster",
    "ActorInfo": "vime.cluster",
    "ActorSettings": "vime.runtime",
    "Cluster": "vime.cluster",
    "Envelope": "vime.transports.codec",
    "PeerGone": "vime.runtime",
    "RemoteError": "vime.runtime",
    "handles": "vime.runtime",
    "message": "vime.transports.records",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'vime' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
