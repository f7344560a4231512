"""The job's model folder on a host that does not share the head's files.

A worker joined by hand (``vime-actor rollout --join``) takes the job's settings from the driver, and with them
the head's ``--model-path``, a folder on the head's host. The worker gets that folder in one of three ways:

* ``vime-actor --model-path DIR``: this host's own copy, checked against the head's (the size and sha256 of
  every file the head's folder holds; extra files are allowed) and refused, naming both folders, when it
  differs;
* the head's path is absolute and exists on this host too (a shared file system): used as it is, unchecked, as
  spawned actors use it (a relative one, the demo's ``runs/NAME/model``, names the head's working folder, not
  this host's);
* otherwise it is fetched from the driver over the job's own socket (its token, its TLS) into a cache folder
  (``--model-cache``, default ``$VIME_MODEL_CACHE`` or ``~/.cache/vime/models``), keyed by the digest of the
  folder's contents, so a later join of the same model on this host transfers nothing.

The cache: ``CACHE/DIGEST/`` is a complete copy, every file checked by sha256 as it arrived. It is made whole in
``CACHE/DIGEST.partial/`` and renamed into place, so a transfer that dies leaves no entry; the whole files
already there stay, checked again, for the next attempt, which fetches only the rest. Each file is written to
``NAME.tmp`` and renamed once its hash matches. An entry is checked again (every file hashed) on each use, and a
damaged file is fetched anew. A lock file serializes joins of one model on one host.

The transfer streams: the worker asks for one chunk of ``CHUNK_BYTES`` at a time and writes it out before it
asks for the next, so neither side holds more than a chunk of a multi-GB file. The driver serves the files its
manifest lists and nothing else: a request names a file of the manifest, never a path to open.

Both halves are here: the driver's (:class:`ModelServer`) and the joined actor's (:func:`local_model_folder`).
Left out: resuming within a file, compression, more than one chunk in flight, and files whose name starts with
"." (a hub's download metadata, ``.git``), which are not part of the model. Tested in ``tests/test_model_files.py``
(the last test joins from a mount namespace where the head's run folder does not exist).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import trio

from vime.messages.model_files import ModelFile, ModelFileChunk, ModelFileRead, ModelManifest, ModelManifestQuery
from vime.runtime import Actor, PeerGone, RemoteError

CHUNK_BYTES = 16 << 20  # one ask's worth: big enough that a round trip per chunk costs little, small enough to hold
MAX_CHUNK_BYTES = 64 << 20  # the most the driver reads for one ask
_HASH_BLOCK = 4 << 20
_PROGRESS_EVERY_S = 10.0


class ModelUnavailable(RuntimeError):
    """This host cannot get the job's model: a ``--model-path`` that is not the head's model, or a fetch that
    failed. The message says why and what to do; ``vime-actor`` prints it and exits with status 2."""


def default_cache() -> Path:
    """Where fetched models go when ``--model-cache`` is not given."""
    if os.environ.get("VIME_MODEL_CACHE"):
        return Path(os.environ["VIME_MODEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vime" / "models"


# ------------------------------------------------------------------ hashing, both sides


def model_files(folder: Path) -> list[tuple[str, Path]]:
    """The files that make up a model folder, as (relative '/'-path, path), sorted: every regular file under it,
    symlinks to files followed (a hub snapshot is made of them), names starting with '.' left out."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = Path(root) / name
            if not name.startswith(".") and path.is_file():
                found.append((path.relative_to(folder).as_posix(), path))
    return sorted(found)


def file_sha256(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """The file's sha256, read a block at a time; ``progress(n)`` after each block of n bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_HASH_BLOCK):
            digest.update(block)
            if progress is not None:
                progress(len(block))
    return digest.hexdigest()


def folder_digest(files: list[ModelFile]) -> str:
    """One digest of a folder's contents: its files' paths, sizes and hashes (what the cache is keyed by)."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda f: f.path):
        digest.update(f"{file.path}\0{file.size}\0{file.sha256}\n".encode())
    return digest.hexdigest()


def differences(folder: Path, files: list[ModelFile], limit: int = 3) -> list[str]:
    """How ``folder`` differs from the manifest's ``files`` (a missing file, another size, other bytes), at most
    ``limit`` of them; empty when it holds every file as listed. Sizes are compared before anything is hashed."""
    found = []
    sized = []
    for file in files:
        path = folder / file.path
        if not path.is_file():
            found.append(f"{file.path} is missing")
        elif path.stat().st_size != file.size:
            found.append(f"{file.path} is {path.stat().st_size} bytes, the head's {file.size}")
        else:
            sized.append((file, path))
    if found:
        return found[:limit]
    for file, path in sized:
        ours = file_sha256(path)
        if ours != file.sha256:
            found.append(f"{file.path} differs (sha256 {ours[:12]}..., the head's {file.sha256[:12]}...)")
            if len(found) == limit:
                break
    return found


# ------------------------------------------------------------------ the driver's half


@dataclasses.dataclass
class _Hashing:
    signature: list[tuple[str, int, int]]  # (path, size, mtime) of every file when hashing started
    total_bytes: int
    hashed_bytes: int = 0
    manifest: ModelManifest | None = None
    error: str | None = None


class ModelServer:
    """The driver's half: the manifest of the job's model folder, and chunks of the files it lists.

    The folder is hashed once, in a worker thread, from the first manifest ask on (the driver's handlers must
    not wait for it: heartbeats are handled between them); asks meanwhile get the progress. Hashed again when
    a file's size or modification time changes.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).absolute()  # as the joined side's messages name it
        self._hashing: _Hashing | None = None
        self._served: dict[str, ModelFile] = {}  # path -> file, of the latest finished manifest

    def manifest(self, start_soon: Callable[..., Any]) -> ModelManifest:
        """The manifest, or how far hashing it has come (starting it with ``start_soon`` if need be)."""
        listed = model_files(self.folder) if self.folder.is_dir() else []
        if not listed:
            raise ValueError(f"the job's model folder {self.folder} holds no files on the driver's host")
        signature = [(name, path.stat().st_size, path.stat().st_mtime_ns) for name, path in listed]
        hashing = self._hashing
        if hashing is None or hashing.signature != signature and (hashing.manifest or hashing.error):
            hashing = self._hashing = _Hashing(signature, sum(size for _, size, _ in signature))
            start_soon(self._hash, hashing, listed)
        if hashing.error:
            raise ValueError(f"the driver could not read the job's model folder {self.folder}: {hashing.error}")
        if hashing.manifest is not None:
            return hashing.manifest
        return ModelManifest(head_path=str(self.folder), ready=False, digest="", files=[],
                             hashed_bytes=hashing.hashed_bytes, total_bytes=hashing.total_bytes)

    async def _hash(self, hashing: _Hashing, listed: list[tuple[str, Path]]) -> None:
        def run() -> list[ModelFile]:
            def progress(count: int) -> None:
                hashing.hashed_bytes += count

            return [ModelFile(path=name, size=path.stat().st_size, sha256=file_sha256(path, progress))
                    for name, path in listed]

        try:
            files = await trio.to_thread.run_sync(run)
        except OSError as err:
            hashing.error = str(err)
            return
        self._served = {file.path: file for file in files}
        hashing.manifest = ModelManifest(head_path=str(self.folder), ready=True, digest=folder_digest(files),
                                         files=files, hashed_bytes=hashing.total_bytes,
                                         total_bytes=hashing.total_bytes)

    async def read(self, msg: ModelFileRead) -> ModelFileChunk:
        """A chunk of a file the manifest lists; ValueError for any other path or a range outside the file."""
        file = self._served.get(msg.path)
        if file is None:
            raise ValueError(f"{msg.path[:200]!r} is not a file of the job's model folder (ask ModelManifestQuery "
                             "for the list; nothing else is served)")
        if msg.offset < 0 or not 0 < msg.size <= MAX_CHUNK_BYTES or msg.offset + msg.size > file.size:
            raise ValueError(f"bytes {msg.offset}+{msg.size} are not within {msg.path} ({file.size} bytes) or over "
                             f"{MAX_CHUNK_BYTES} at once")
        data = await trio.to_thread.run_sync(lambda: np.fromfile(self.folder / file.path, dtype=np.uint8,
                                                                  count=msg.size, offset=msg.offset))
        if len(data) != msg.size:
            raise ValueError(f"{msg.path} is shorter on the driver's host than when it was hashed")
        return ModelFileChunk(path=msg.path, offset=msg.offset, data=data)


# ------------------------------------------------------------------ the joined actor's half


async def local_model_folder(actor: Actor, head_path: str) -> str:
    """The folder this host builds the job's model from (see the module's docstring for the three ways).

    Blocks until it is there: while the driver hashes its folder, and while a fetch lasts, asking one chunk at a
    time (``actor.settings.model_fetch_timeout_s`` for each); the actor's heartbeats go on meanwhile. Raises
    ModelUnavailable when ``--model-path`` is not the head's model, or the fetch fails (the driver gone, a file
    changed on the head mid-way); nothing half-written is then left as a cache entry.
    """
    given = actor.settings.model_path
    spawned = actor.settings.parent_pid is not None  # by the driver, on its host and in its folder
    if given is None and Path(head_path).is_dir() and (spawned or Path(head_path).is_absolute()):
        if not spawned:  # joined by hand: say which copy it runs on
            actor.log.info("the head's model folder is on this host too: using it as it is, unchecked (pass "
                           "--model-path to have a copy checked)", model_path=head_path)
        return head_path
    if given is not None and not Path(given).is_dir():
        raise ModelUnavailable(f"--model-path {given}: no such folder on this host; pass a copy of the head's model "
                               f"folder ({head_path} there), or leave --model-path out and this host fetches it")
    manifest = await _ask_manifest(actor)
    if given is not None:
        problems = await trio.to_thread.run_sync(differences, Path(given), manifest.files)
        if problems:
            raise ModelUnavailable(
                f"--model-path {given} is not the job's model, the head's {manifest.head_path} (digest "
                f"{manifest.digest[:12]}): {'; '.join(problems)}. Pass a copy of the head's folder, or leave "
                "--model-path out and this host fetches it from the head")
        actor.log.info("using this host's copy of the model, checked", model_path=given,
                       files=len(manifest.files), digest=manifest.digest[:12])
        return given
    cache = Path(actor.settings.model_cache) if actor.settings.model_cache else default_cache()
    return str(await _cached_copy(actor, manifest, cache))


async def _ask_manifest(actor: Actor) -> ModelManifest:
    timeout = actor.settings.model_fetch_timeout_s
    last_said = 0.0
    while True:
        manifest = await _ask(actor, ModelManifestQuery(), timeout, "the list of the model's files")
        if manifest.ready:
            return manifest
        if time.monotonic() - last_said > _PROGRESS_EVERY_S:
            last_said = time.monotonic()
            actor.log.info("waiting for the driver to hash its model folder", hashed_bytes=manifest.hashed_bytes,
                           total_bytes=manifest.total_bytes)
        await trio.sleep(0.2)


async def _ask(actor: Actor, request: Any, timeout: float, what: str) -> Any:
    try:
        return await actor.ask("driver", request, timeout=timeout)
    except (TimeoutError, PeerGone) as err:
        raise ModelUnavailable(f"the driver at {actor.settings.driver} did not send {what} within {timeout:.0f} s "
                               "(--model-fetch-timeout-s): is the job still running?") from err
    except RemoteError as err:
        raise ModelUnavailable(f"the driver at {actor.settings.driver} refused to send {what}: "
                               f"{err.reply.error}") from err


async def _cached_copy(actor: Actor, manifest: ModelManifest, cache: Path) -> Path:
    """The cache entry of ``manifest``'s folder: checked and used when it is there, else fetched (only the files
    missing, damaged, or not yet whole from an earlier attempt)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / f"{manifest.digest}.lock", "a")
    except OSError as err:
        raise ModelUnavailable(f"cannot use the model cache {cache} ({err}); pass --model-cache DIR, a folder this "
                               "user may write, or --model-path DIR, a copy of the head's model") from err
    entry = cache / manifest.digest
    partial = cache / f"{manifest.digest}.partial"
    size = sum(file.size for file in manifest.files)
    with lock:  # closing it lets the next join of this model on this host go on
        await trio.to_thread.run_sync(fcntl.flock, lock, fcntl.LOCK_EX)
        started = time.monotonic()
        good: set[str] = set()
        if entry.is_dir():
            good, bad = await trio.to_thread.run_sync(_check, entry, manifest.files)
            if not bad:
                actor.log.info("model from the cache", model_path=str(entry), files=len(good), bytes=size,
                               fetched_bytes=0, checked_s=round(time.monotonic() - started, 2))
                return entry
            actor.log.warning("cached model damaged: fetching those files again", model_path=str(entry),
                              files=sorted(bad)[:10])
            shutil.rmtree(partial, ignore_errors=True)
            entry.rename(partial)
        elif partial.is_dir():  # an earlier attempt died: keep its whole files that still check
            good, bad = await trio.to_thread.run_sync(_check, partial, manifest.files)
        for stale in partial.rglob("*") if partial.is_dir() else ():
            name = stale.relative_to(partial).as_posix()
            if stale.is_file() and name not in good:
                stale.unlink()
        missing = [file for file in manifest.files if file.path not in good]
        fetched, seconds = await _fetch(actor, manifest, partial, missing)
        partial.rename(entry)
        actor.log.info("model fetched", model_path=str(entry), files=len(missing), bytes=fetched,
                       cached_files=len(good), seconds=round(seconds, 2),
                       mb_per_s=round(fetched / max(seconds, 1e-9) / 1e6, 1))
        return entry


def _check(folder: Path, files: list[ModelFile]) -> tuple[set[str], set[str]]:
    """The files of ``folder`` that match the manifest, and those that do not (or are missing)."""
    good, bad = set(), set()
    for file in files:
        path = folder / file.path
        whole = path.is_file() and path.stat().st_size == file.size and file_sha256(path) == file.sha256
        (good if whole else bad).add(file.path)
    return good, bad


async def _fetch(actor: Actor, manifest: ModelManifest, partial: Path, files: list[ModelFile]) -> tuple[int, float]:
    """Fetch ``files`` into ``partial``, each checked by sha256 before it is renamed into place; the bytes
    fetched and the seconds it took."""
    total = sum(file.size for file in files)
    actor.log.info("fetching the model from the head", head_path=manifest.head_path, files=len(files), bytes=total,
                   into=str(partial))
    started = last_said = time.monotonic()
    fetched = 0
    timeout = actor.settings.model_fetch_timeout_s
    for file in files:
        target = partial / file.path
        tmp = target.with_name(target.name + ".tmp")
        digest = hashlib.sha256()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as out:
                offset = 0
                while offset < file.size:
                    size = min(CHUNK_BYTES, file.size - offset)
                    chunk = await _ask(actor, ModelFileRead(path=file.path, offset=offset, size=size), timeout,
                                       f"{file.path} (bytes {offset}+{size})")
                    if chunk.path != file.path or chunk.offset != offset or chunk.data.nbytes != size:
                        raise ModelUnavailable(f"the driver sent other bytes than asked for {file.path} at {offset}")
                    await trio.to_thread.run_sync(_write, out, digest, chunk.data)
                    offset += size
                    fetched += size
                    actor.counters["model_bytes_fetched"] += size
                    if time.monotonic() - last_said > _PROGRESS_EVERY_S:
                        last_said = time.monotonic()
                        actor.log.info("fetching the model", fetched_bytes=fetched, bytes=total)
                out.flush()
                os.fsync(out.fileno())
            if digest.hexdigest() != file.sha256:
                raise ModelUnavailable(f"{file.path} arrived with another sha256 than the head's manifest says "
                                       "(was it changed on the head mid-way?); join again")
            os.replace(tmp, target)
        except (ModelUnavailable, OSError) as err:
            tmp.unlink(missing_ok=True)
            kept = sum(1 for f in manifest.files if (partial / f.path).is_file())
            raise ModelUnavailable(f"{err}. The model was not cached: {fetched} of {total} bytes had arrived; "
                                   f"{kept} whole files are kept in {partial} for the next join") from err
        actor.counters["model_files_fetched"] += 1
    return fetched, time.monotonic() - started


def _write(out: Any, digest: Any, data: np.ndarray) -> None:
    view = memoryview(data).cast("B")
    out.write(view)
    digest.update(view)
