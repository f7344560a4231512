"""The job's model folder, fetched from the driver by an actor that joined from a host without it.

    joined actor --ModelManifestQuery--> driver --ModelManifest--> (again, while the driver is still hashing)
    joined actor --ModelFileRead--> driver --ModelFileChunk--> (one chunk at a time, until every file is in)

Both halves are in ``vime.model_files``.
"""

from __future__ import annotations

import numpy as np

from vime.transports.records import message


@message
class ModelManifestQuery:
    """joined actor -> driver (ask): which files make up the job's model folder; answered with ModelManifest.
    ``sizes_only``: the files and their sizes at once, nothing hashed (a host that has the head's path checks
    it so)."""

    sizes_only: bool = False


@message(kind_name=False)
class ModelFile:
    """One file of the model folder: its path relative to the folder ('/'-separated), size and sha256."""

    path: str
    size: int
    sha256: str


@message
class ModelManifest:
    """driver -> asker, the answer to ModelManifestQuery: the model folder file by file and one digest of them all.
    The driver hashes the folder once, in the background, starting at the first ask: until it is done ``ready`` is
    False, ``files`` empty, and ``hashed_bytes`` of ``total_bytes`` say how far it got. The answer to a
    ``sizes_only`` query is never ready, and lists the files with an empty sha256."""

    head_path: str  # the folder on the driver's host (the job's --model-path)
    ready: bool
    digest: str
    files: list[ModelFile]
    hashed_bytes: int
    total_bytes: int


@message
class ModelFileRead:
    """joined actor -> driver (ask): bytes ``[offset, offset + size)`` of one file the manifest lists; answered with
    ModelFileChunk. Any other path is refused."""

    path: str
    offset: int
    size: int


@message
class ModelFileChunk:
    """driver -> asker, the answer to ModelFileRead: the bytes, framed beside the header (never copied into it).
    Left out of message logs (``vime.inbound.UNRECORDED_KINDS``): they would hold the whole model."""

    path: str
    offset: int
    data: np.ndarray  # uint8
