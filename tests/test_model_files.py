"""A joined actor on a host without the job's model folder (``vime.model_files``): fetched from the driver over
the job's socket, checked by sha256 and cached by contents; a second join reuses the cache, a damaged cache file is
fetched again, a ``--model-path`` that is not the head's model is refused naming both, the driver serves nothing
but the files of its model folder, and a head that dies mid-transfer leaves no cache entry.

The first tests join an actor in this process (real sockets, a real driver); the last one trains with a rollout
worker that runs in a mount namespace where the head's run folder does not exist, as on another host."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import AsyncIterator

import pytest
import trio
from test_async import hold_run_until_serving

from conftest import make_tls_files, open_job
from vime import model_files
from vime.cluster import Cluster
from vime.messages.model_files import ModelFileRead, ModelManifestQuery
from vime.messages.runtime import StatusQuery
from vime.model_files import ModelUnavailable, local_model_folder
from vime.pipeline import train
from vime.runtime import Actor, ActorSettings, RemoteError
from vime.scenarios import arithmetic

FILES = {"config.json": b'{"model_type": "tiny"}', "model.safetensors": os.urandom(600_000),
         "sub/tokenizer.json": b'{"vocab": [1, 2, 3]}', "empty.txt": b""}


def _model(folder: Path) -> Path:
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "download.lock").write_text("not part of the model")
    return folder


@pytest.fixture
def small_chunks(monkeypatch):
    """Files of several chunks: the chunking is what is under test, not the size."""
    monkeypatch.setattr(model_files, "CHUNK_BYTES", 64 << 10)


class _Joiner(Actor):
    role = "joiner"


@contextlib.asynccontextmanager
async def _joined(job_address: str, token: str, cache: Path, **settings) -> AsyncIterator[Actor]:
    """An actor joined to the driver at ``job_address``, in this process, serving until the block ends."""
    scheme = job_address.partition("://")[0]
    actor = _Joiner(ActorSettings(name=f"joiner-{os.urandom(3).hex()}", listen=f"{scheme}://127.0.0.1:0",
                                  driver=job_address, token=token, model_cache=str(cache), **settings))
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(actor.serve, handle_signals=False))
        try:
            yield actor
        finally:
            actor.stop()


async def test_a_host_without_the_model_fetches_it_once_checks_it_and_then_uses_its_cache(tmp_path, small_chunks):
    head = _model(tmp_path / "head-model")
    cache = tmp_path / "cache"
    elsewhere = str(tmp_path / "not-on-this-host")  # the head's path, as a host without it sees it
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, cache) as actor:
            fetched = Path(await local_model_folder(actor, elsewhere))
            assert fetched.parent == cache and fetched.name == (await actor.ask("driver", ModelManifestQuery())).digest
            assert {p.relative_to(fetched).as_posix(): p.read_bytes() for p in fetched.rglob("*") if p.is_file()} \
                == FILES  # every file, byte for byte; the hub's dot-folder is not part of the model
            assert actor.counters["model_bytes_fetched"] == sum(map(len, FILES.values()))
            assert actor.counters["model_files_fetched"] == len(FILES)
            assert sorted(p.name for p in cache.iterdir()) == sorted([fetched.name, f"{fetched.name}.lock"])

        async with _joined(job.address, job.token, cache) as again:
            assert await local_model_folder(again, elsewhere) == str(fetched)
            assert again.counters["model_bytes_fetched"] == 0  # the cache, checked, and nothing sent

        damaged = bytearray((fetched / "model.safetensors").read_bytes())
        damaged[1000] ^= 0xFF  # same size: only the hash can tell
        (fetched / "model.safetensors").write_bytes(bytes(damaged))
        (fetched / "sub" / "tokenizer.json").unlink()
        async with _joined(job.address, job.token, cache) as third:
            assert await local_model_folder(third, elsewhere) == str(fetched)
            assert third.counters["model_bytes_fetched"] == len(FILES["model.safetensors"]) + len(
                FILES["sub/tokenizer.json"])  # only the two damaged files came again
            assert (fetched / "model.safetensors").read_bytes() == FILES["model.safetensors"]

        async with _joined(job.address, job.token, cache) as shared:  # the head's path is here: used as it is
            assert await local_model_folder(shared, str(head)) == str(head)
            assert shared.counters["model_bytes_fetched"] == 0


async def test_the_model_travels_over_tls_when_the_job_uses_it(tmp_path, small_chunks):
    head = _model(tmp_path / "head-model")
    tls = make_tls_files(tmp_path / "tls")
    async with open_job(tmp_path / "run", transport="tls+tcp", tls=tls, model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache", tls_cert_key=tls["cert_key"],
                           tls_ca=tls["ca"]) as actor:
            fetched = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
            assert actor.counters["model_bytes_fetched"] == sum(map(len, FILES.values()))
    assert (fetched / "model.safetensors").read_bytes() == FILES["model.safetensors"]


async def test_a_model_path_given_is_checked_against_the_heads_and_refused_naming_both(tmp_path):
    head = _model(tmp_path / "head-model")
    copy = tmp_path / "my-copy"
    shutil.copytree(head, copy)
    (copy / "README.md").write_text("an extra file is fine")
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache", model_path=str(copy)) as actor:
            assert await local_model_folder(actor, str(head)) == str(copy)
        (copy / "config.json").write_text('{"model_type": "another"}')
        (copy / "sub" / "tokenizer.json").unlink()
        async with _joined(job.address, job.token, tmp_path / "cache", model_path=str(copy)) as actor:
            with pytest.raises(ModelUnavailable) as refused:
                await local_model_folder(actor, str(head))
        async with _joined(job.address, job.token, tmp_path / "cache", model_path=str(tmp_path / "typo")) as actor:
            with pytest.raises(ModelUnavailable, match="typo: no such folder on this host"):
                await local_model_folder(actor, str(head))
    said = str(refused.value)
    assert f"--model-path {copy} is not the job's model, the head's {head}" in said, said
    assert "config.json is 25 bytes" in said and "sub/tokenizer.json is missing" in said, said
    assert not (tmp_path / "cache").exists()  # nothing was fetched


async def test_the_driver_serves_only_the_files_of_its_model_folder(tmp_path):
    head = _model(tmp_path / "run" / "model")
    (tmp_path / "run" / "join").write_text("export VIME_TOKEN=secret")
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            async def refused(path: str, offset: int = 0, size: int = 10) -> str:
                with pytest.raises(RemoteError) as error:
                    await actor.ask("driver", ModelFileRead(path=path, offset=offset, size=size))
                return error.value.reply.error

            assert "is not a file of the job's model folder" in await refused("config.json")  # no manifest made yet
            with trio.fail_after(30):
                while not (await actor.ask("driver", ModelManifestQuery())).ready:
                    await trio.sleep(0.05)
            for path in ("../join", "/etc/passwd", str(head / "config.json"), "sub/../../join", ".cache/download.lock",
                         "sub", "", "config.json/../../join"):
                assert "is not a file of the job's model folder" in await refused(path), path
            assert "not within" in await refused("config.json", offset=20, size=10)
            assert "not within" in await refused("config.json", offset=-1)
            assert "not within" in await refused("model.safetensors", size=1 << 30)
            chunk = await actor.ask("driver", ModelFileRead(path="sub/tokenizer.json", offset=2, size=5))
            assert bytes(chunk.data) == FILES["sub/tokenizer.json"][2:7]
    async with open_job(tmp_path / "bare", transport="tcp") as job:  # a job without a model folder shares none
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            with pytest.raises(ModelUnavailable, match="shares no model folder"):
                await local_model_folder(actor, str(tmp_path / "elsewhere"))


HEAD = """
import sys, trio
from vime.cluster import Cluster

async def main():
    async with Cluster.open(sys.argv[1], transport="tcp", model_folder=sys.argv[2]) as job:
        print(job.address, job.token, flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


@contextlib.asynccontextmanager
async def _head(run_dir: Path, model: Path) -> AsyncIterator[tuple[trio.Process, str, str]]:
    """A driver serving ``model`` in a process of its own, to be killed: (process, address, token)."""
    process = await trio.lowlevel.open_process([sys.executable, "-c", HEAD, str(run_dir), str(model)],
                                               stdout=subprocess.PIPE)
    try:
        with trio.fail_after(60):
            line = b""
            while not line.endswith(b"\n"):
                line += await process.stdout.receive_some(1024)
        address, token = line.decode().split()
        yield process, address, token
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)  # ends the driver's block: it removes its socket folder
            with trio.move_on_after(15):
                await process.wait()
            process.kill()
        await process.wait()


async def test_a_head_that_dies_mid_transfer_leaves_no_cache_entry_and_the_next_join_fetches_the_rest(
        tmp_path, small_chunks):
    head = _model(tmp_path / "head-model")
    (head / "zz-big.bin").write_bytes(os.urandom(24 << 20))  # sent last (files go in name order), 384 chunks
    cache = tmp_path / "cache"
    total = sum(p.stat().st_size for _, p in model_files.listed_files(head))
    async with _head(tmp_path / "run1", head) as (process, address, token):
        async with _joined(address, token, cache, model_fetch_timeout_s=3.0) as actor:
            async def kill_mid_file() -> None:
                with trio.fail_after(60):
                    while not [p for p in cache.glob("*.partial/zz-big.bin.tmp") if p.stat().st_size > (1 << 20)]:
                        await trio.sleep(0.002)
                process.kill()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_mid_file)
                with pytest.raises(ModelUnavailable) as failed:
                    await local_model_folder(actor, str(tmp_path / "elsewhere"))
            arrived = actor.counters["model_bytes_fetched"]
    said = str(failed.value)
    assert "did not send zz-big.bin" in said and "is the job still running?" in said, said
    assert f"The model was not cached: {arrived} of {total} bytes had arrived; 4 whole files are kept in" in said
    assert 0 < arrived < total
    partial, = cache.glob("*.partial")
    assert not [p for p in cache.iterdir() if p.is_dir() and not p.name.endswith(".partial")]  # no entry
    assert not list(partial.rglob("*.tmp"))  # nor a half file
    (partial / "zz-big.bin.tmp").write_bytes(b"what a joiner killed with kill -9 leaves")
    (partial / "config.json").write_bytes(b'{"model_type": "TINY"}')  # a kept file damaged since
    async with _head(tmp_path / "run2", head) as (_, address, token):
        async with _joined(address, token, cache) as actor:
            entry = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
            # the whole files kept were not sent again, the damaged one was
            assert actor.counters["model_bytes_fetched"] == (24 << 20) + len(FILES["config.json"])
    assert entry == partial.with_suffix("") and not partial.exists()
    assert model_files.differences(entry, [f for f in (await _manifest_of(head)).files]) == []


async def _manifest_of(folder: Path):
    async with trio.open_nursery() as nursery:
        server = model_files.ModelServer(folder)
        while not (manifest := await server.manifest(nursery.start_soon)).ready:
            await trio.sleep(0.01)
    return manifest


_UNSHARES = (["unshare", "--user", "--map-root-user", "--mount"], ["unshare", "--mount"])


def _unshare(folder: Path) -> tuple[list[str] | None, str]:
    """The unshare command that can hide ``folder`` here under a tmpfs (a user namespace first: no root needed),
    or None and why none can."""
    if shutil.which("unshare") is None:
        return None, "unshare (util-linux) is not installed"
    said = []
    for unshare in _UNSHARES:
        tried = subprocess.run([*unshare, "sh", "-c", 'mount -t tmpfs tmpfs "$0"', str(folder)],
                               capture_output=True, text=True)
        if tried.returncode == 0:
            return unshare, ""
        said.append(f"{' '.join(unshare)}: {tried.stderr.strip()}")
    return None, f"no mount namespace with a tmpfs mount here (user namespaces off, and not root): {'; '.join(said)}"


async def _join_elsewhere(unshare: list[str], hidden: Path, run_dir: Path, address: str, token: str, name: str,
                          log: Path, *flags: str) -> trio.Process:
    """``vime-actor rollout --join`` as on another host: in a mount namespace of its own where ``hidden`` (which
    holds the head's run folder, and the model in it) is an empty tmpfs."""
    script = f'mount -t tmpfs tmpfs "$0" && test ! -e {run_dir} && exec "$@"'
    command = [*unshare, "sh", "-c", script, str(hidden), sys.executable, "-m", "vime.actor", "rollout",
               "--join", address, "--name", name, *flags]
    with open(log, "wb") as out:
        return await trio.lowlevel.open_process(command, stdout=out, stderr=out,
                                                env=dict(os.environ, VIME_TOKEN=token, PYTHONUNBUFFERED="1"))


def _events(log: Path) -> dict[str, dict]:
    """The JSON lines of an actor's log, by event (the last of each)."""
    found = {}
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and "event" in entry:
                found[entry["event"]] = entry
    return found


async def test_a_worker_on_a_host_without_the_heads_run_folder_fetches_the_model_and_trains(tmp_path):
    """The README's join, tried from a host that does not share the head's files: the demo's model lives in the
    head's run folder, which the joining worker cannot see. It fetches the model, builds its engine from the
    cached copy, and generates groups that are trained; a second worker there starts from the cache; a
    --model-path that is not the head's model is refused with exit status 2. Before: the worker died building
    its engine from a path that does not exist there."""
    hidden = tmp_path / "head"
    run_dir = hidden / "run"
    run_dir.mkdir(parents=True)
    unshare, why_not = _unshare(hidden)
    if unshare is None:
        pytest.skip(why_not)
    cache, wrong = tmp_path / "cache", tmp_path / "wrong-model"
    config = arithmetic.prepare(run_dir, arithmetic.defaults().replace(steps=8, rollout_batch_size=8,
                                                                      max_staleness=1))
    shutil.copytree(config.model.model_path, wrong)
    (wrong / "config.json").write_text((wrong / "config.json").read_text().replace('"hidden_size": 128',
                                                                                   '"hidden_size": 256'))
    seen: dict[str, trio.Process] = {}

    async def join(job: Cluster, row: dict) -> None:
        if row["step"] != 1:
            return
        seen["far-1"] = await _join_elsewhere(unshare, hidden, run_dir, job.address, job.token, "far-1",
                                              tmp_path / "far-1.log", "--model-cache", str(cache))
        await hold_run_until_serving(job, "far-1", "joined")
        with trio.fail_after(60):
            while not (await job.ask("router", StatusQuery())).counters.get("dispatched_to:far-1"):
                await trio.sleep(0.05)
        job.kill("buffer", signal.SIGSTOP)  # the run waits while the next two start
        try:
            seen["far-1"].send_signal(signal.SIGTERM)  # it leaves; its groups are handed back
            seen["far-2"] = await _join_elsewhere(unshare, hidden, run_dir, job.address, job.token, "far-2",
                                                  tmp_path / "far-2.log", "--model-cache", str(cache))
            seen["wrong"] = await _join_elsewhere(unshare, hidden, run_dir, job.address, job.token, "far-wrong",
                                                  tmp_path / "far-wrong.log", "--model-cache", str(cache),
                                                  "--model-path", str(wrong))
            with trio.fail_after(90):
                await seen["wrong"].wait()
                await seen["far-1"].wait()
        finally:
            job.kill("buffer", signal.SIGCONT)
        await hold_run_until_serving(job, "far-2", "joined")

    try:
        summary = await train(config, run_dir, transport="tcp", on_step=join, timeout_s=400)
    finally:
        for process in seen.values():
            if process.returncode is None:
                with trio.move_on_after(30):  # the job's end shuts a joined worker down
                    await process.wait()
                process.kill()
    first, second = _events(tmp_path / "far-1.log"), _events(tmp_path / "far-2.log")
    model_bytes = sum(p.stat().st_size for _, p in model_files.listed_files(Path(config.model.model_path)))
    fetched = first["model fetched"]
    assert fetched["bytes"] == model_bytes and fetched["files"] == len(list(Path(config.model.model_path).iterdir()))
    assert Path(fetched["model_path"]).parent == cache and "joined" in first
    assert seen["far-1"].returncode == 0 and summary["workers"]["far-1"]["groups"] > 0  # it generated; trained
    assert "fetching the model from the head" not in second and second["model from the cache"]["fetched_bytes"] == 0
    assert second["model from the cache"]["model_path"] == fetched["model_path"] and "joined" in second
    said = (tmp_path / "far-wrong.log").read_text()
    assert seen["wrong"].returncode == 2, said[-2000:]
    assert f"--model-path {wrong} is not the job's model, the head's {config.model.model_path}" in said, said[-2000:]
    assert "config.json differs" in said
    assert summary["groups"]["lost"] == 0 and summary["groups"]["trained_twice"] == 0
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 8


async def test_a_relative_head_path_is_not_taken_for_this_hosts_copy(tmp_path, monkeypatch):
    """The demo's --model-path, runs/NAME/model, names a folder of the head's working folder: a worker joined by
    hand from another folder (or host) that happens to hold one of that name fetches the head's instead."""
    head = _model(tmp_path / "head" / "runs" / "x" / "model")
    here = tmp_path / "joiner"
    (here / "runs" / "x" / "model").mkdir(parents=True)  # another model, or none, under the same name
    monkeypatch.chdir(tmp_path / "head")
    async with open_job(tmp_path / "head" / "run", transport="tcp", model_folder="runs/x/model") as job:
        monkeypatch.chdir(here)
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            fetched = await local_model_folder(actor, "runs/x/model")
    assert Path(fetched).parent == tmp_path / "cache" and actor.counters["model_files_fetched"] == len(FILES)
    assert (Path(fetched) / "config.json").read_bytes() == (head / "config.json").read_bytes()


def _idle_joiner(cache: Path) -> Actor:
    """A joiner that never serves: enough for the cache functions, which refuse before they ask anything."""
    return _Joiner(ActorSettings(name="idle-joiner", listen="tcp://127.0.0.1:0", model_cache=str(cache)))


def _forged(files: list[tuple[str, bytes]], digest: str | None = None):
    from vime.messages.model_files import ModelFile, ModelManifest
    listed = [ModelFile(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest()) for path, data in files]
    return ModelManifest(head_path="/head", ready=True, digest=digest or model_files.folder_digest(listed),
                         files=listed, hashed_bytes=0, total_bytes=0)


@pytest.mark.parametrize("files, digest, why", [
    ([("../escape.txt", b"x")], None, "not a plain relative path"),
    ([("/tmp/escape.txt", b"x")], None, "not a plain relative path"),
    ([("sub/../../escape.txt", b"x")], None, "not a plain relative path"),
    ([("a//b", b"x")], None, "not a plain relative path"),
    ([("./a", b"x")], None, "not a plain relative path"),
    ([(".git/config", b"x")], None, "not a plain relative path"),
    ([("a", b"x"), ("a", b"x")], None, "listed twice"),
    ([("a", b"x"), ("a/b", b"y")], None, "as a file and as the folder of"),
    ([("a", b"x")], "../../proj", "not 64 hex digits"),
    ([("a", b"x")], "0" * 64, "not the digest of the files it lists"),
])
async def test_a_forged_manifest_is_refused_before_anything_is_written_or_deleted(tmp_path, files, digest, why):
    """Before: a path of the manifest was joined to the cache folder as it came (an absolute one or '..' wrote
    anywhere) and its digest named the folders removed and renamed (a digest '../../proj' removed 'proj')."""
    victim = tmp_path / "proj"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    cache = tmp_path / "a" / "b" / "cache"
    with pytest.raises(ModelUnavailable, match=why):
        await model_files._cached_copy(_idle_joiner(cache), _forged(files, digest), cache)
    assert not (tmp_path / "a").exists() and not (tmp_path / "escape.txt").exists()
    assert (victim / "keep.txt").read_text() == "mine"


async def test_a_file_is_never_written_through_a_symlink_out_of_the_partial_copy(tmp_path):
    """The second guard: a path the manifest check lets through, that a symlink planted in the partial folder
    would send elsewhere."""
    outside = tmp_path / "outside"
    outside.mkdir()
    partial = tmp_path / "cache" / "x.partial"
    partial.mkdir(parents=True)
    (partial / "sub").symlink_to(outside)
    manifest = _forged([("sub/model.bin", b"data")])
    with pytest.raises(ModelUnavailable, match="would be written outside"):
        await model_files._fetch(_idle_joiner(tmp_path / "cache"), manifest, partial, manifest.files)
    assert list(outside.iterdir()) == []


async def test_a_chunk_with_other_bytes_than_the_manifest_says_is_not_kept(tmp_path, small_chunks):
    """The per-file sha256: the head's file changes after its manifest was made, keeping its size and mtime (so the
    driver keeps the old manifest and serves the new bytes): the joiner refuses the file, keeps no cache entry,
    no partial file of it and no .tmp. Before: no test failed without the check."""
    head = _model(tmp_path / "head-model")
    cache = tmp_path / "cache"
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, cache) as actor:
            with trio.fail_after(30):
                while not (await actor.ask("driver", ModelManifestQuery())).ready:
                    await trio.sleep(0.05)
            weights = head / "model.safetensors"
            stat = weights.stat()
            weights.write_bytes(os.urandom(stat.st_size))
            os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
            with pytest.raises(ModelUnavailable, match="model.safetensors arrived with another sha256") as failed:
                await local_model_folder(actor, str(tmp_path / "elsewhere"))
    assert "join again" in str(failed.value)
    partial, = cache.glob("*.partial")
    assert not [p for p in cache.iterdir() if p.is_dir() and not p.name.endswith(".partial")]
    assert not (partial / "model.safetensors").exists() and not list(partial.rglob("*.tmp"))


async def test_heartbeats_are_stamped_as_they_arrive_not_behind_a_slow_handler(tmp_path, monkeypatch):
    """A chunk read that takes longer than the driver's dead_after_s: the joiner's heartbeats, which arrive
    meanwhile, keep it alive. Before: they waited behind the read and the joiner was declared dead."""
    head = _model(tmp_path / "head-model")
    original = model_files.ModelServer.read

    async def slow_read(self, msg):
        await trio.to_thread.run_sync(time.sleep, 2.5)
        return await original(self, msg)

    monkeypatch.setattr(model_files.ModelServer, "read", slow_read)
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head, dead_after_s=1.0) as job:
        async with _joined(job.address, job.token, tmp_path / "cache", heartbeat_s=0.2) as actor:
            with trio.fail_after(30):
                while not (await actor.ask("driver", ModelManifestQuery())).ready:
                    await trio.sleep(0.05)
            await actor.ask("driver", ModelFileRead(path="config.json", offset=0, size=5))
            assert not [e for e in job.events if e.what == "died" and e.name == actor.name], job.events


async def test_the_driver_refuses_a_read_while_the_askers_previous_chunk_has_not_left(tmp_path, monkeypatch):
    """One chunk in flight per worker: a worker asking for more without taking what it was sent is refused (it
    cannot pile chunks up in the driver's memory); an honest worker refused so asks again and gets its model."""
    from vime.cluster import _Driver
    head = _model(tmp_path / "head-model")
    queued = iter([1, 1, 1])
    monkeypatch.setattr(_Driver, "unsent_to", lambda self, name: next(queued, 0))
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            fetched = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
            assert (fetched / "model.safetensors").read_bytes() == FILES["model.safetensors"]
            monkeypatch.setattr(_Driver, "unsent_to", lambda self, name: 1)
            with pytest.raises(RemoteError, match="has not left the driver yet"):
                await actor.ask("driver", ModelFileRead(path="config.json", offset=0, size=5))


async def test_reads_are_bounded(tmp_path, monkeypatch):
    head = _model(tmp_path / "head-model")
    monkeypatch.setattr(model_files, "MAX_CHUNK_BYTES", 1000)
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            with trio.fail_after(30):
                while not (await actor.ask("driver", ModelManifestQuery())).ready:
                    await trio.sleep(0.05)
            for offset, size in ((0, 0), (0, -1), (-5, 10), (0, 1001)):
                with pytest.raises(RemoteError, match="not within"):
                    await actor.ask("driver", ModelFileRead(path="model.safetensors", offset=offset, size=size))
            chunk = await actor.ask("driver", ModelFileRead(path="model.safetensors", offset=100, size=1000))
            assert bytes(chunk.data) == FILES["model.safetensors"][100:1100]


async def test_the_driver_lives_through_a_hashing_failure_and_tries_again(tmp_path, monkeypatch):
    """Any error while hashing is the asker's to hear (before: only OSError was; anything else ended the driver),
    and the next ask hashes again (before: the error stayed until a file changed)."""
    head = _model(tmp_path / "head-model")
    original, failures = model_files.file_sha256, iter([RuntimeError("a bad sector, say")])

    def flaky(path, progress=None):
        if (error := next(failures, None)) is not None:
            raise error
        return original(path, progress)

    monkeypatch.setattr(model_files, "file_sha256", flaky)
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            with trio.fail_after(30):
                while True:
                    try:
                        await actor.ask("driver", ModelManifestQuery())
                    except RemoteError as refused:
                        assert "RuntimeError: a bad sector, say" in refused.reply.error
                        break
                    await trio.sleep(0.05)
            fetched = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
            assert (fetched / "config.json").read_bytes() == FILES["config.json"]


async def test_a_file_name_that_is_not_utf8_is_refused_and_the_driver_goes_on(tmp_path):
    head = _model(tmp_path / "head-model")
    os.close(os.open(os.fsencode(head) + b"/bad-\xff.bin", os.O_CREAT | os.O_WRONLY))
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            with pytest.raises(ModelUnavailable, match="not UTF-8"):
                await local_model_folder(actor, str(tmp_path / "elsewhere"))
            assert (await actor.ask("driver", StatusQuery())).name == "driver"  # still serving


async def test_the_driver_lists_its_folder_at_most_once_a_second(tmp_path, monkeypatch):
    head = _model(tmp_path / "head-model")
    listings = []
    original = model_files.listed_files
    monkeypatch.setattr(model_files, "listed_files", lambda folder: listings.append(1) or original(folder))
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            for _ in range(20):
                await actor.ask("driver", ModelManifestQuery())
    assert len(listings) <= 2  # 20 asks within about a second


async def test_the_driver_hashes_again_after_its_folder_changed(tmp_path, small_chunks):
    head = _model(tmp_path / "head-model")
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            first = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
        (head / "config.json").write_text('{"model_type": "tiny", "retrained": true}')
        await trio.sleep(1.1)  # the driver's listing is at most a second old
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            second = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
            assert actor.counters["model_bytes_fetched"] == sum(map(len, FILES.values())) + 19
    assert first != second and json.loads((second / "config.json").read_text())["retrained"] is True


async def test_two_joins_on_one_host_fetch_the_model_once(tmp_path, small_chunks):
    """The cache's lock: two workers joining at once on one host make one entry, and the model crosses once."""
    head = _model(tmp_path / "head-model")
    cache = tmp_path / "cache"
    entries = []
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, cache) as one, _joined(job.address, job.token, cache) as two:
            async def join(actor):
                entries.append(await local_model_folder(actor, str(tmp_path / "elsewhere")))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(join, one)
                nursery.start_soon(join, two)
            fetched = one.counters["model_bytes_fetched"] + two.counters["model_bytes_fetched"]
    assert entries[0] == entries[1] and fetched == sum(map(len, FILES.values()))


async def test_a_stop_is_heard_while_waiting_for_the_lock_and_between_chunks(tmp_path, small_chunks):
    """SIGTERM (here stop()) while another join holds the cache's lock, or mid-fetch: the worker gives up at once,
    leaving no entry and no half file. Before: it sat in flock() or fetched to the end."""
    head = _model(tmp_path / "head-model")
    (head / "zz-big.bin").write_bytes(os.urandom(4 << 20))  # 64 chunks
    cache = tmp_path / "cache"
    cache.mkdir()
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, cache) as actor:
            manifest = await model_files._ask_manifest(actor)
            with open(cache / f"{manifest.digest}.lock", "a") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                with trio.fail_after(30):
                    async with trio.open_nursery() as nursery:
                        async def stop_soon():
                            await trio.sleep(1.0)
                            actor.stop()

                        nursery.start_soon(stop_soon)
                        with pytest.raises(ModelUnavailable, match="while another join on this host fetched"):
                            await local_model_folder(actor, str(tmp_path / "elsewhere"))
        async with _joined(job.address, job.token, cache) as actor:
            async def stop_mid_file():
                while actor.counters["model_bytes_fetched"] < (1 << 20):
                    await trio.sleep(0.001)
                actor.stop()

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stop_mid_file)
                    with pytest.raises(ModelUnavailable, match="told to stop .* while fetching zz-big.bin"):
                        await local_model_folder(actor, str(tmp_path / "elsewhere"))
            assert actor.counters["model_bytes_fetched"] < (3 << 20)
    assert not (cache / manifest.digest).exists() and not list(cache.rglob("*.tmp"))


async def test_a_recorded_run_leaves_the_models_bytes_out_of_its_message_logs(tmp_path):
    head = _model(tmp_path / "head-model")
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head, record=True) as job:
        async with _joined(job.address, job.token, tmp_path / "cache", record=True,
                           run_dir=str(tmp_path / "run")) as actor:
            await local_model_folder(actor, str(tmp_path / "elsewhere"))
    logs = {p.name: p.stat().st_size for p in (tmp_path / "run" / "messages").glob("*.vlog")}
    assert "driver.vlog" in logs and f"{actor.name}.vlog" in logs, logs
    assert all(size < len(FILES["model.safetensors"]) for size in logs.values()), logs


async def test_symlinks_to_files_are_served_wherever_they_point(tmp_path):
    """A hub snapshot: the model folder's files are relative symlinks into ../../blobs, outside it; one more
    inside the folder. Each is served as the file it points to; a symlinked folder is not entered."""
    hub = tmp_path / "models--org--tiny"
    snapshot = hub / "snapshots" / "abc123"
    (hub / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (hub / "blobs" / "1f2e").write_bytes(FILES["model.safetensors"])
    (snapshot / "model.safetensors").symlink_to("../../blobs/1f2e")
    (snapshot / "config.json").write_bytes(FILES["config.json"])
    (snapshot / "same-config.json").symlink_to("config.json")
    (snapshot / "blobs").symlink_to(hub / "blobs", target_is_directory=True)
    async with open_job(tmp_path / "run", transport="tcp", model_folder=snapshot) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            fetched = Path(await local_model_folder(actor, str(tmp_path / "elsewhere")))
    assert {p.relative_to(fetched).as_posix(): p.read_bytes() for p in fetched.rglob("*") if p.is_file()} == {
        "model.safetensors": FILES["model.safetensors"], "config.json": FILES["config.json"],
        "same-config.json": FILES["config.json"]}
    assert not any(p.is_symlink() for p in fetched.rglob("*"))


async def test_an_actor_a_node_started_checks_the_folder_at_the_heads_path(tmp_path):
    """Started by a node agent (``--node``), an actor is not on the driver's host even though it has a parent:
    a folder at the head's path there (shared storage, or another model of the same name) is checked, not taken
    as it is. Before the fix it was taken unchecked, as if the driver had spawned the actor beside it."""
    head = _model(tmp_path / "head-model")
    other = tmp_path / "same-name-elsewhere"
    shutil.copytree(head, other)
    (other / "config.json").write_text('{"model_type": "another model"}')
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache", parent_pid=os.getppid(), node="node-b") as actor:
            fetched = Path(await local_model_folder(actor, str(other)))
            assert fetched.parent == tmp_path / "cache" and actor.counters["model_files_fetched"] == len(FILES)


async def test_an_absolute_head_path_on_this_host_is_used_only_when_its_sizes_are_the_heads(tmp_path):
    head = _model(tmp_path / "head-model")
    other = tmp_path / "same-name-elsewhere"  # a folder at the head's absolute path, but not its model
    shutil.copytree(head, other)
    async with open_job(tmp_path / "run", transport="tcp", model_folder=head) as job:
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            assert await local_model_folder(actor, str(other)) == str(other)
            assert actor.counters["model_bytes_fetched"] == 0
        (other / "config.json").write_text('{"model_type": "another model"}')
        async with _joined(job.address, job.token, tmp_path / "cache") as actor:
            fetched = Path(await local_model_folder(actor, str(other)))
            assert fetched.parent == tmp_path / "cache" and actor.counters["model_files_fetched"] == len(FILES)
