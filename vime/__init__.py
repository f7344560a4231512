"""vime: RL post-training for LLMs on lightweight nng actors.

The public runtime surface is re-exported here; implementations live in the
modules named for what they are (runtime, cluster, messages, transports).
"""

from vime.cluster import ActorEvent, ActorInfo, Cluster
from vime.runtime import Actor, ActorSettings, PeerGone, RemoteError, handles
from vime.transports.codec import Envelope
from vime.transports.records import message

__all__ = [
    "Actor",
    "ActorEvent",
    "ActorInfo",
    "ActorSettings",
    "Cluster",
    "Envelope",
    "PeerGone",
    "RemoteError",
    "handles",
    "message",
]
