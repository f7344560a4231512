"""Weight sync: how the weights of each new version travel from the trainer to the rollout engines.

The control messages always travel over nng; the bytes, by the fastest path the placement allows. Each path is
one module here holding both its halves (the trainer's sender, the worker's receiver) and its message kinds:

* ``nng`` (:class:`Nng`): chunks over the actors' sockets. CPU, tests, small models, hosts without a GPU
  link; it reaches every worker, so it is also the fallback.
* ``cuda_ipc`` (:class:`CudaIpc`, ``--weight-sync ipc``): the engine on the trainer's own GPUs; only
  descriptors of a bucket the trainer packed cross the socket.
* ``nccl`` (:class:`Broadcast`, ``--weight-sync broadcast``): a broadcast group of their own (NCCL on GPUs,
  gloo on CPU), the engine on other GPUs or hosts.
* ``nng_delta`` (:class:`NngDelta`, ``--weight-sync nng-delta``): nng chunks of only what changed since the
  version the worker holds (XOR with it, zstd), exact; for engines across a slow link. Only when named.

The interface (:mod:`vime.weights.base`): a path's sender half attaches a worker, sends it a version and detaches
it; its receiver half receives the path's messages and has the engine load them between two of its steps.
The trainer holds a :class:`WeightSender` and a rollout worker a :class:`WeightReceiver`, which serve every path.

How a path is chosen (:func:`choose`): when a worker asks WantWeights with the GPUs of its engine, the trainer
compares them with its own. Under ``--weight-sync auto`` the highest-priority path that suits the placement
wins (CUDA IPC when the engine's GPUs are all the trainer's, broadcast when they share none, nng otherwise);
a path named explicitly is refused, with what it needs, when the placement does not allow it. A worker whose
GPU path cannot be set up (a broadcast group that cannot form) or fails (a load that raises or does not
answer) gets that version and every later one over nng: :meth:`WeightSender.attach` and
:meth:`WeightSender.publish`, written once for every path.

Adding a path (a file system shared with the workers) is adding a module here
with one :class:`WeightPath` subclass: every module of this package is imported below, and a subclass
registers itself by its ``name``; its ``--weight-sync`` value is also listed in ``vime.config.WeightSync``, which
is read without torch (tests/test_weights_delta.py checks the two agree).
"""

import importlib
import pkgutil

from vime.weights.base import PATHS, WantWeights, WeightPath, WeightReceiver, WeightsComing, WeightSender, choose

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from vime.weights.cuda_ipc import BucketLoaded, CudaIpc, WeightsShared  # noqa: E402
from vime.weights.nccl import Broadcast, BroadcastJoin, BroadcastJoined, BroadcastLoaded, WeightsBroadcast  # noqa: E402
from vime.weights.nng import Nng, WeightsChunk  # noqa: E402
from vime.weights.nng_delta import DeltaHeld, NngDelta, WeightsDelta  # noqa: E402

RECEIVED: tuple[type, ...] = tuple(kind for path in PATHS.values() for kind in path.kinds)  # a worker's handler's

__all__ = [
    "PATHS",
    "RECEIVED",
    "Broadcast",
    "BroadcastJoin",
    "BroadcastJoined",
    "BroadcastLoaded",
    "BucketLoaded",
    "CudaIpc",
    "DeltaHeld",
    "Nng",
    "NngDelta",
    "WantWeights",
    "WeightPath",
    "WeightReceiver",
    "WeightSender",
    "WeightsBroadcast",
    "WeightsChunk",
    "WeightsComing",
    "WeightsDelta",
    "WeightsShared",
    "choose",
]
