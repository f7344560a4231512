"""The job's model folder on a host that does not share the head's files.

A worker joined by hand (``vime-actor rollout --join``) takes the job's settings from the driver, and with them
the head's ``--model-path``, a folder on the head's host. The worker gets that folder in one of three ways:

* ``vime-actor --model-path DIR``: this host's own copy, checked against the head's (the size and sha256 of
  every file the head's folder holds; extra files are allowed) and refused, naming both folders, when it
  differs;
* the head's path is absolute and exists on this host too (a shared file system): used as it is once every
  file the head lists is there with the head's size (not hashed: that is what a shared file system is for);
  a folder of that name that differs is not the head's, and the model is fetched instead. A relative one, the
  demo's ``runs/NAME/model``, names the head's working folder, not this host's;
* otherwise it is fetched from the driver over the job's own socket (its token, its TLS) into a cache folder
  (``--model-cache``, default ``$VIME_MODEL_CACHE``, else ``$XDG_CACHE_HOME/vime/models``, else
  ``~/.cache/vime/models``), keyed by the digest of the folder's contents, so a later join of the same model on
  this host transfers nothing.

The cache: ``CACHE/DIGEST/`` is a complete copy, every file checked by sha256 as it arrived. It is made whole in
``CACHE/DIGEST.partial/`` and renamed into place, so a transfer that dies leaves no entry; the whole files
already there stay, checked again, for the next attempt, which fetches only the rest. Each file is written to
``NAME.tmp`` and renamed once its hash matches. An entry is checked again (every file hashed) on each use, and a
damaged file is fetched anew. A lock file serializes joins of one model on one host (a second one waits, saying
so, and then finds the entry made). Nothing is ever evicted: remove ``CACHE/DIGEST`` by hand.

What the driver sends is not trusted to name places: a manifest is refused unless its digest is its files'
digest and every path is a plain relative path inside the folder (no ``..``, no absolute path, no part starting
with '.', no file that is another's folder), so a forged one cannot write or delete outside the cache entry.

The transfer streams: the worker asks for one chunk of ``CHUNK_BYTES`` at a time and writes it out before it
asks for the next, so neither side holds more than a chunk of a multi-GB file; the driver reads at most
``MAX_CHUNK_BYTES`` for one ask and refuses a worker's next read while its previous chunk has not left. The
driver serves the files its manifest lists and nothing else: a request names a file of the manifest, never a
path to open. Symlinks to files are followed wherever they point (a hub snapshot's point into ``../../blobs``):
the head's operator chose the folder; symlinked folders are not entered.

Both halves are here: the driver's (:class:`ModelServer`) and the joined actor's (:func:`local_model_folder`).
Left out: resuming within a file, compression, more than one chunk in flight, eviction, and files whose name
starts with "." (a hub's download metadata, ``.git``), which are not part of the model. Tested in
``tests/test_model_files.py`` (the last test joins from a mount namespace where the head's run folder does not
exist).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any, Awaitable, BinaryIO, Callable, TypeVar

import numpy as np
import trio

from vime.messages.model_files import ModelFile, ModelFileChunk, ModelFileRead, ModelManifest, ModelManifestQuery
from vime.runtime import Actor, PeerGone, RemoteError

CHUNK_BYTES = 16 << 20  # one ask's worth: big enough that a round trip per chunk costs little, small enough to hold
MAX_CHUNK_BYTES = 16 << 20  # the most the driver reads for one ask
# The driver's refusal of a read while the asker's previous chunk is still queued on the driver; the worker
# waits and asks again (a heartbeat's Directory can sit in that queue for a moment too).
CHUNK_NOT_LEFT = "the previous chunk to this worker has not left the driver yet (one chunk in flight per worker)"
_HASH_BLOCK = 4 << 20
_PROGRESS_EVERY_S = 10.0
_LIST_EVERY_S = 1.0  # the driver lists its folder at most this often, however many joiners ask
_LOCK_POLL_S = 0.5
_RETRY_S = 0.05
_HEX = frozenset("0123456789abcdef")
_Reply = TypeVar("_Reply")


class ModelUnavailable(RuntimeError):
    """This host cannot get the job's model: a ``--model-path`` that is not the head's model, or a fetch that
    failed. The message says why and what to do; ``vime-actor`` prints it and exits with status 2."""


def default_cache() -> Path:
    """Where fetched models go when ``--model-cache`` is not given."""
    if os.environ.get("VIME_MODEL_CACHE"):
        return Path(os.environ["VIME_MODEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vime" / "models"


# ------------------------------------------------------------------ hashing, both sides


def listed_files(folder: Path) -> list[tuple[str, Path]]:
    """The files that make up a model folder, as (relative '/'-path, path), sorted: every regular file under it,
    symlinks to files followed (a hub snapshot is made of them), names starting with '.' left out. ValueError
    for a name that is not UTF-8 (it could not travel in a manifest)."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            path = Path(root) / name
            if not name.startswith(".") and path.is_file():
                relative = path.relative_to(folder).as_posix()
                try:
                    relative.encode()
                except UnicodeEncodeError:
                    raise ValueError(f"{os.fsencode(path)!r} in the model folder has a name that is not UTF-8; "
                                     "rename it (or move it out of the folder)") from None
                found.append((relative, path))
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


def _mismatch(path: Path, file: ModelFile, *, hashed: bool = True) -> str | None:
    """How the file at ``path`` differs from the manifest's ``file`` (missing, another size, other bytes), or None;
    with ``hashed=False`` only its size is compared."""
    if not path.is_file():
        return f"{file.path} is missing"
    size = path.stat().st_size
    if size != file.size:
        return f"{file.path} is {size} bytes, the head's {file.size}"
    if hashed:
        ours = file_sha256(path)
        if ours != file.sha256:
            return f"{file.path} differs (sha256 {ours[:12]}..., the head's {file.sha256[:12]}...)"
    return None


def differences(folder: Path, files: list[ModelFile], limit: int = 3, *, hashed: bool = True) -> list[str]:
    """How ``folder`` differs from the manifest's ``files``, at most ``limit`` of them; empty when it holds every
    file as listed. Sizes are compared before anything is hashed (and only they with ``hashed=False``)."""
    found = [why for file in files if (why := _mismatch(folder / file.path, file, hashed=False))]
    if found or not hashed:
        return found[:limit]
    for file in files:
        if why := _mismatch(folder / file.path, file):
            found.append(why)
            if len(found) == limit:
                break
    return found


def _whole_files(folder: Path, files: list[ModelFile]) -> set[str]:
    """The files of ``folder`` that match the manifest (size and sha256)."""
    return {file.path for file in files if _mismatch(folder / file.path, file) is None}


def _untrusted(why: str) -> ModelUnavailable:
    return ModelUnavailable(f"the driver sent a model manifest this host does not trust: {why}. Nothing was "
                            "written; is the --join address the job's driver? Join again")


def check_manifest(manifest: ModelManifest) -> None:
    """Refuse (ModelUnavailable) a manifest that could make this host write or delete outside its cache entry: its
    digest must be its files' digest (64 hex digits), each file's sha256 64 hex digits, and its paths as
    :func:`check_paths` wants them."""
    if len(manifest.digest) != 64 or not set(manifest.digest) <= _HEX:
        raise _untrusted(f"its digest {manifest.digest[:80]!r} is not 64 hex digits")
    for file in manifest.files:
        if len(file.sha256) != 64 or not set(file.sha256) <= _HEX:
            raise _untrusted(f"the sha256 of {file.path[:200]!r} is not 64 hex digits")
    if manifest.digest != folder_digest(manifest.files):
        raise _untrusted("its digest is not the digest of the files it lists")
    check_paths(manifest.files)


def check_paths(files: list[ModelFile]) -> None:
    """Refuse (ModelUnavailable) paths that could name a place outside the folder: each must be a relative
    '/'-path of plain names (none empty, '.', '..' or starting with '.'), listed once, none the folder of
    another, with a size of 0 or more."""
    paths = set()
    for file in files:
        parts = file.path.split("/")
        if "\0" in file.path or any(part in ("", ".", "..") or part.startswith(".") for part in parts):
            raise _untrusted(f"{file.path[:200]!r} is not a plain relative path inside the model folder")
        if file.size < 0:
            raise _untrusted(f"{file.path[:200]!r} has a size of {file.size}")
        if file.path in paths:
            raise _untrusted(f"{file.path[:200]!r} is listed twice")
        paths.add(file.path)
    for path in paths:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            if (folder := "/".join(parts[:depth])) in paths:
                raise _untrusted(f"{folder[:200]!r} is listed as a file and as the folder of {path[:200]!r}")


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

    The folder is listed in a worker thread, at most once a second however many joiners ask, and hashed once,
    in a worker thread, from the first manifest ask on (the driver's handlers must not wait for it); asks
    meanwhile get the progress. Hashed again when a file's size or modification time changes, and tried again
    on the next ask after hashing failed. A cancelled driver (Ctrl-C) abandons a hash in progress; the thread
    only reads.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).absolute()  # as the joined side's messages name it
        self._hashing: _Hashing | None = None
        self._served: dict[str, ModelFile] = {}  # path -> file, of the latest finished manifest
        self._listed: list[tuple[str, Path]] = []
        self._signature: list[tuple[str, int, int]] = []
        self._listed_at = -_LIST_EVERY_S

    async def manifest(self, start_soon: Callable[..., Any], sizes_only: bool = False) -> ModelManifest:
        """The manifest, or how far hashing it has come (starting it with ``start_soon`` if need be). With
        ``sizes_only``: the files with their sizes and no hashes, at once, and nothing hashed."""
        if time.monotonic() - self._listed_at >= _LIST_EVERY_S:
            self._listed, self._signature = await trio.to_thread.run_sync(self._list)
            self._listed_at = time.monotonic()
        listed, signature = self._listed, self._signature
        if not listed:
            raise ValueError(f"the job's model folder {self.folder} holds no files on the driver's host")
        total = sum(size for _, size, _ in signature)
        if sizes_only:
            return ModelManifest(head_path=str(self.folder), ready=False, digest="",
                                 files=[ModelFile(path=name, size=size, sha256="") for name, size, _ in signature],
                                 hashed_bytes=0, total_bytes=total)
        hashing = self._hashing
        if hashing is not None and hashing.error is not None:
            self._hashing = None  # the next ask tries again: a file may be readable again without changing
            raise ValueError(f"the driver could not read the job's model folder {self.folder}: {hashing.error}")
        if hashing is None or (hashing.manifest is not None and hashing.signature != signature):
            hashing = self._hashing = _Hashing(signature, total)
            start_soon(self._hash, hashing, listed)
        if hashing.manifest is not None:
            return hashing.manifest
        return ModelManifest(head_path=str(self.folder), ready=False, digest="", files=[],
                             hashed_bytes=hashing.hashed_bytes, total_bytes=hashing.total_bytes)

    def _list(self) -> tuple[list[tuple[str, Path]], list[tuple[str, int, int]]]:
        listed = listed_files(self.folder) if self.folder.is_dir() else []
        stats = [path.stat() for _, path in listed]
        return listed, [(name, stat.st_size, stat.st_mtime_ns) for (name, _), stat in zip(listed, stats)]

    async def _hash(self, hashing: _Hashing, listed: list[tuple[str, Path]]) -> None:
        def run() -> list[ModelFile]:
            def progress(count: int) -> None:
                hashing.hashed_bytes += count

            files = [ModelFile(path=name, size=path.stat().st_size, sha256=file_sha256(path, progress))
                     for name, path in listed]
            return files

        try:
            files = await trio.to_thread.run_sync(run, abandon_on_cancel=True)
            digest = folder_digest(files)
        except Exception as err:  # any failure is the asker's to hear about, never the job's end
            hashing.error = f"{type(err).__name__}: {err}"
            return
        self._served = {file.path: file for file in files}
        hashing.manifest = ModelManifest(head_path=str(self.folder), ready=True, digest=digest,
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

    Blocks until it is there: while the driver hashes its folder, while another join on this host fetches the
    same model, and while a fetch lasts, asking one chunk at a time (``actor.settings.model_fetch_timeout_s``
    for each); the actor's heartbeats go on meanwhile (every write, fsync and rename runs in a thread). Raises
    ModelUnavailable when ``--model-path`` is not the head's model, the fetch fails (the driver gone, a file
    changed on the head mid-way), or the actor is told to stop (SIGTERM, Ctrl-C) while it waits or fetches;
    nothing half-written is then left as a cache entry.
    """
    given = actor.settings.model_path
    # spawned by the driver (on its host, in its folder; not by a node agent elsewhere), or started alone with no
    # driver to ask (tests, replay)
    local = (actor.settings.parent_pid is not None and actor.settings.node is None) or actor.settings.driver is None
    if given is None and local and Path(head_path).is_dir():
        return head_path
    if given is None and Path(head_path).is_absolute() and Path(head_path).is_dir():
        listing = await _ask(actor, ModelManifestQuery(sizes_only=True), ModelManifest,
                             actor.settings.model_fetch_timeout_s, "the list of the model's files")
        check_paths(listing.files)
        problems = await trio.to_thread.run_sync(functools.partial(differences, Path(head_path), listing.files,
                                                                   hashed=False))
        if not problems:
            actor.log.info("the head's model folder is on this host too: using it as it is, sizes checked, not "
                           "hashed (pass --model-path to have a copy hashed)", model_path=head_path)
            return head_path
        actor.log.warning("a folder of the head's model path is on this host but it is not the head's model: "
                          "fetching the head's", model_path=head_path, differences=problems)
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
        manifest = await _ask(actor, ModelManifestQuery(), ModelManifest, timeout, "the list of the model's files")
        if manifest.ready:
            check_manifest(manifest)
            return manifest
        if time.monotonic() - last_said > _PROGRESS_EVERY_S:
            last_said = time.monotonic()
            actor.log.info("waiting for the driver to hash its model folder", hashed_bytes=manifest.hashed_bytes,
                           total_bytes=manifest.total_bytes)
        _stop_if_told(actor, "while the driver hashed its model folder")
        await trio.sleep(0.2)


async def _ask(actor: Actor, request: object, reply: type[_Reply], timeout: float, what: str) -> _Reply:
    """The driver's answer to ``request``, a ``reply``; ModelUnavailable, saying why, for anything else."""
    try:
        answer = await actor.ask("driver", request, timeout=timeout)
    except (TimeoutError, PeerGone) as err:
        raise ModelUnavailable(f"the driver at {actor.settings.driver} did not send {what} within {timeout:.0f} s "
                               "(--model-fetch-timeout-s): is the job still running? Join again once it is") from err
    except RemoteError as err:
        raise ModelUnavailable(f"the driver at {actor.settings.driver} refused to send {what}: "
                               f"{err.reply.error}; join again once that is fixed") from err
    if not isinstance(answer, reply):
        raise ModelUnavailable(f"the driver at {actor.settings.driver} answered the ask for {what} with "
                               f"{type(answer).__name__}, not {reply.__name__}; join again")
    return answer


async def _unless_stopped(actor: Actor, when: str, ask: Callable[[], Awaitable[_Reply]]) -> _Reply:
    """``await ask()``, given up (ModelUnavailable, as _stop_if_told says) as soon as the actor is told to stop."""
    answers: list[_Reply] = []
    failed: list[Exception] = []  # raised here, not from the nursery, where it would come wrapped in a group
    async with trio.open_nursery() as nursery:
        async def asking() -> None:
            try:
                answers.append(await ask())
            except Exception as err:
                failed.append(err)
            nursery.cancel_scope.cancel()

        async def until_stop() -> None:
            await actor.wait_stopping()
            nursery.cancel_scope.cancel()

        nursery.start_soon(asking)
        nursery.start_soon(until_stop)
    if failed:
        raise failed[0]
    _stop_if_told(actor, when)
    return answers[0]


def _stop_if_told(actor: Actor, when: str) -> None:
    if actor.stopping:
        raise ModelUnavailable(f"told to stop (SIGTERM, Ctrl-C or Shutdown) {when}; the model was not cached. "
                               "Join again to go on: whole files fetched so far are kept")


async def _cached_copy(actor: Actor, manifest: ModelManifest, cache: Path) -> Path:
    """The cache entry of ``manifest``'s folder: checked and used when it is there, else fetched (only the files
    missing, damaged, or not yet whole from an earlier attempt). Refuses a manifest :func:`check_manifest`
    refuses before it touches the cache."""
    check_manifest(manifest)  # the digest and paths below name places on this host
    try:
        await trio.to_thread.run_sync(functools.partial(cache.mkdir, parents=True, exist_ok=True))
        lock = open(cache / f"{manifest.digest}.lock", "a")
    except OSError as err:
        raise ModelUnavailable(f"cannot use the model cache {cache} ({err}); pass --model-cache DIR, a folder this "
                               "user may write, or --model-path DIR, a copy of the head's model") from err
    entry = cache / manifest.digest
    partial = cache / f"{manifest.digest}.partial"
    size = sum(file.size for file in manifest.files)
    with lock:  # closing it lets the next join of this model on this host go on
        await _take_lock(actor, lock, entry)
        started = time.monotonic()
        good: set[str] = set()
        try:
            if entry.is_dir():
                good = await trio.to_thread.run_sync(_whole_files, entry, manifest.files)
                if len(good) == len(manifest.files):
                    actor.log.info("model from the cache", model_path=str(entry), files=len(good), bytes=size,
                                   fetched_bytes=0, checked_s=round(time.monotonic() - started, 2))
                    return entry
                actor.log.warning("cached model damaged: fetching those files again", model_path=str(entry),
                                  files=sorted(f.path for f in manifest.files if f.path not in good)[:10])
                await trio.to_thread.run_sync(_reopen, entry, partial)
            elif partial.is_dir():  # an earlier attempt died: keep its whole files that still check
                good = await trio.to_thread.run_sync(_whole_files, partial, manifest.files)
            await trio.to_thread.run_sync(_remove_stale, partial, good)
        except OSError as err:
            raise ModelUnavailable(f"cannot prepare {partial} in the model cache ({err}); remove it, or pass "
                                   "--model-cache DIR, and join again") from err
        missing = [file for file in manifest.files if file.path not in good]
        fetched, seconds = await _fetch(actor, manifest, partial, missing)
        try:
            await trio.to_thread.run_sync(partial.rename, entry)
        except OSError as err:
            raise ModelUnavailable(f"the model was fetched into {partial} but could not be renamed to {entry} "
                                   f"({err}); remove {entry} if it is in the way and join again") from err
        actor.log.info("model fetched", model_path=str(entry), files=len(missing), bytes=fetched,
                       cached_files=len(good), seconds=round(seconds, 2),
                       mb_per_s=round(fetched / max(seconds, 1e-9) / 1e6, 1))
        return entry


async def _take_lock(actor: Actor, lock: IO[str], entry: Path) -> None:
    """Hold the cache's lock on this model, polling so that a stop (SIGTERM) is heard while another join has it."""
    said = False
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if not said:
            said = True
            actor.log.info("waiting for another join on this host fetching this model", model_path=str(entry))
        _stop_if_told(actor, "while another join on this host fetched the same model")
        await trio.sleep(_LOCK_POLL_S)


def _reopen(entry: Path, partial: Path) -> None:
    """Make a damaged entry the partial copy again (its whole files are kept)."""
    shutil.rmtree(partial, ignore_errors=True)
    entry.rename(partial)


def _remove_stale(partial: Path, good: set[str]) -> None:
    """Delete every file in ``partial`` but the whole ones: a killed join's ``.tmp``, damaged files."""
    if not partial.is_dir():
        return
    for stale in list(partial.rglob("*")):
        if (stale.is_file() or stale.is_symlink()) and stale.relative_to(partial).as_posix() not in good:
            stale.unlink()


async def _fetch(actor: Actor, manifest: ModelManifest, partial: Path, files: list[ModelFile]) -> tuple[int, float]:
    """Fetch ``files`` into ``partial``, each checked by sha256 before it is renamed into place; the bytes
    fetched and the seconds it took. The actor's stop is heard between chunks."""
    total = sum(file.size for file in files)
    actor.log.info("fetching the model from the head", head_path=manifest.head_path, files=len(files), bytes=total,
                   into=str(partial))
    started = last_said = time.monotonic()
    fetched = 0
    timeout = actor.settings.model_fetch_timeout_s
    try:
        root = await trio.to_thread.run_sync(_made_root, partial)
    except OSError as err:
        raise ModelUnavailable(f"cannot write {partial} in the model cache ({err}); pass --model-cache DIR, a "
                               "folder this user may write, and join again") from err
    for file in files:
        target = partial / file.path
        tmp = target.with_name(target.name + ".tmp")
        digest = hashlib.sha256()
        try:
            if not target.resolve().is_relative_to(root):  # check_manifest makes this impossible; kept as a guard
                raise ModelUnavailable(f"{file.path[:200]!r} would be written outside {partial}")
            out = await trio.to_thread.run_sync(_open_new, tmp)
            try:
                offset = 0
                while offset < file.size:
                    _stop_if_told(actor, f"while fetching {file.path}")
                    size = min(CHUNK_BYTES, file.size - offset)
                    chunk = await _read_chunk(actor, file.path, offset, size, timeout)
                    await trio.to_thread.run_sync(_write, out, digest, chunk.data)
                    offset += size
                    fetched += size
                    actor.counters["model_bytes_fetched"] += size
                    if time.monotonic() - last_said > _PROGRESS_EVERY_S:
                        last_said = time.monotonic()
                        actor.log.info("fetching the model", fetched_bytes=fetched, bytes=total)
                if digest.hexdigest() != file.sha256:
                    raise ModelUnavailable(f"{file.path} arrived with another sha256 than the head's manifest says "
                                           "(was it changed on the head mid-way?); join again")
                await trio.to_thread.run_sync(_flush_to_disk, out)
            finally:
                out.close()  # cheap once flushed; synchronous so that a cancellation cannot skip it
            await trio.to_thread.run_sync(os.replace, tmp, target)
        except (ModelUnavailable, OSError) as err:
            tmp.unlink(missing_ok=True)
            kept = sum(1 for f in manifest.files if (partial / f.path).is_file())
            raise ModelUnavailable(f"{err}. The model was not cached: {fetched} of {total} bytes had arrived; "
                                   f"{kept} whole files are kept in {partial} for the next join") from err
        actor.counters["model_files_fetched"] += 1
    return fetched, time.monotonic() - started


async def _read_chunk(actor: Actor, path: str, offset: int, size: int, timeout: float) -> ModelFileChunk:
    """Bytes ``[offset, offset + size)`` of ``path``, checked to be what was asked for; asked again while the
    driver says the previous chunk has not left it (within ``timeout`` in all)."""
    what = f"{path} (bytes {offset}+{size})"
    deadline = trio.current_time() + timeout
    while True:
        try:
            chunk = await _unless_stopped(actor, f"while fetching {path}", functools.partial(
                _ask, actor, ModelFileRead(path=path, offset=offset, size=size), ModelFileChunk,
                max(deadline - trio.current_time(), 0.001), what))
            break
        except ModelUnavailable as err:
            refused = err.__cause__
            if not (isinstance(refused, RemoteError) and CHUNK_NOT_LEFT in refused.reply.error
                    and trio.current_time() < deadline):
                raise
        await trio.sleep(_RETRY_S)
    data = chunk.data
    if not (chunk.path == path and chunk.offset == offset and isinstance(data, np.ndarray)
            and data.dtype == np.uint8 and data.ndim == 1 and data.flags.c_contiguous and data.nbytes == size):
        raise ModelUnavailable(f"the driver sent other bytes than asked for {what}; join again")
    return chunk


def _made_root(partial: Path) -> Path:
    partial.mkdir(parents=True, exist_ok=True)
    return partial.resolve()


def _open_new(tmp: Path) -> BinaryIO:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return open(tmp, "wb")


def _write(out: BinaryIO, digest: hashlib._Hash, data: np.ndarray) -> None:
    view = memoryview(data).cast("B")
    out.write(view)
    digest.update(view)


def _flush_to_disk(out: BinaryIO) -> None:
    out.flush()
    os.fsync(out.fileno())
