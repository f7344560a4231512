"""Fuzz over the wire: garbage sent through real sockets to every actor kind, the join path and the HTTP endpoint.

``tests/test_fuzz.py`` calls ``_accept_frame`` in-process; here the same frames travel through nng:

* **actor targets** (buffer, router, rollout, reward, trainer) x (ipc, tcp, tls+tcp): each actor listens
  as in a job with a join token and is sent random bytes, mutated frames signed with a wrong token,
  frames with the right token whose messages break their kind's schema, frames whose reply address
  is bogus (``tls+tcp://`` to a plain actor, ``tcp://[::1``, ``ws://``), now and then a frame over the
  inbox's size limit, and raw connections that speak neither nng's handshake nor TLS;
* **join targets**: a real driver (``vime.Cluster``) on each transport, sent the same plus broken
  ``Register`` messages; afterwards a real actor registers;
* **http**: a rollout worker serving ``--openai-endpoint`` (the Qwen3 tokenizer's tiny model when the
  shared data folder has it, else the arithmetic one given a chat template), sent malformed HTTP, huge
  headers, invalid JSON, a wrong type in every field of every route, streams whose client vanishes after
  the first chunk, and slow-loris bodies held open until the server's read deadline.

Per target it records frames (requests) sent, the ones the actor read, accepted (handled; for HTTP,
a 2xx answer to garbage; must be 0), the actor's own error counters (from ``StatusQuery``), whether a
real request is answered afterwards, and the actor's RSS after a warm-up and at the end. Actors run in
child processes (``--child``) so that their RSS is theirs alone; bench/ measures, it never decides.

Usage::

    nice .venv/bin/python bench/fuzz.py --json bench/results/fuzz-cpu.json          # 100,000 per target
    nice .venv/bin/python bench/fuzz.py --frames 2000 --targets buffer/tcp,http

Left out: several fuzzers at once, links across hosts, shared-memory attachments (a stranger cannot
name a segment it may map: frames with a wrong token map none).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pynng
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_frames import TOKEN, attack, example_group, frame, tls_files  # noqa: E402
from fuzz_http import HttpFuzz, claim, fuzz_http  # noqa: E402

from vime.devtools.shared_data import shared_data  # noqa: E402
from vime.logs import configure  # noqa: E402
from vime.messages.runtime import Register, Registered, StatusQuery  # noqa: E402
from vime.runtime import Actor, ActorSettings  # noqa: E402
from vime.transports.http import READ_TIMEOUT_S  # noqa: E402
from vime.transports.sockets import TlsFiles  # noqa: E402

ROLES = ("buffer", "router", "rollout", "reward", "trainer")
TRANSPORTS = ("ipc", "tcp", "tls+tcp")
MAX_MESSAGE_BYTES = 1 << 16  # the inbox then refuses frames over 4 x this + 16 MiB (vime.runtime)
QWEN3_TOKENIZER = shared_data() / "qwen3-tokenizer"
STARTED_ROLES = {"rollout", "reward"}  # the others' on_start talks to peers that are not there


@dataclasses.dataclass
class Result:
    """One target's figures; ``accepted`` counts garbage that reached a handler (or got a 2xx)."""

    target: str
    sent: int = 0
    read_by_actor: int = 0
    accepted: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    raw_connections: int = 0
    serving_after: bool = False
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    seconds: float = 0.0
    stopped_by_time_limit: bool = False
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)


# ------------------------------------------------------------------ the target side (child or in-process)


def prepare_configs(folder: Path) -> dict[str, str]:
    """The job's config for the actors, and for the HTTP target one whose rollout serves agents; JSON files."""
    from vime.scenarios import arithmetic

    config = arithmetic.prepare(folder, arithmetic.defaults())
    # The endpoint renders agents' messages with the chat template: without one every completion is refused,
    # and the vanishing streams would never stream.
    if (QWEN3_TOKENIZER / "tokenizer.json").is_file():
        from vime.devtools.make_tiny_model import make_tiny_model

        model = make_tiny_model("qwen3", QWEN3_TOKENIZER, folder / "qwen3-model", seed=0)
    else:  # a machine without the shared data folder (CI's checkout): the arithmetic model, given a template
        model = with_chat_template(Path(config.model.model_path), folder / "chat-model")
    http = config.replace(model_path=str(model), openai_endpoint="127.0.0.1:0", chat_template=True,
                          max_response_tokens=64)
    paths = {"actor": folder / "config.json", "http": folder / "config-http.json"}
    paths["actor"].write_text(json.dumps(config.to_dict()))
    paths["http"].write_text(json.dumps(http.to_dict()))
    return {key: str(path) for key, path in paths.items()}


ARITHMETIC_CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['content'] }}</s>{% endfor %}"
                            "{% if add_generation_prompt %}<s>{% endif %}")


def with_chat_template(model: Path, out: Path) -> Path:
    """A copy of the arithmetic ``model`` whose tokenizer has a chat template (turns as ``<s>text</s>``; its
    16 tokens cannot spell the roles): enough for the endpoint to render conversations and insert turns."""
    from vime.backends.hf import load_tokenizer

    shutil.copytree(model, out, dirs_exist_ok=True)
    tokenizer = load_tokenizer(out)
    tokenizer.chat_template = ARITHMETIC_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def listen_address(transport: str, folder: Path, name: str) -> str:
    return f"ipc://{folder}/{name}" if transport == "ipc" else f"{transport}://127.0.0.1:0"


async def serve_target(spec: dict[str, Any], task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED
                       ) -> None:
    """Serve one target until its ``stop`` is called (an actor also stops on SIGTERM when ``spec["signals"]``);
    ``started`` gets where to reach it (its URL too for HTTP), its pid and ``stop``."""
    tls = spec.get("tls") or {}
    if spec["kind"] == "join":
        from vime import Cluster

        stopped = trio.Event()
        async with Cluster.open(spec["run_dir"], transport=spec["transport"], token=TOKEN, tls=tls or None) as job:
            task_status.started({"address": job.address, "name": "driver", "pid": os.getpid(), "stop": stopped.set})
            await stopped.wait()
        return
    actor = build_actor(spec)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: actor.serve(handle_signals=spec.get("signals", False),
                                                            task_status=task_status))
        url = None
        if spec["kind"] == "http":
            endpoint = Path(spec["run_dir"]) / "endpoints" / actor.name
            with trio.fail_after(60):
                while not endpoint.exists():
                    await trio.sleep(0.05)
            url = endpoint.read_text().strip()
        task_status.started({"address": actor.address, "name": actor.name, "url": url, "pid": os.getpid(),
                             "stop": actor.stop})


def build_actor(spec: dict[str, Any]) -> Actor:
    """The role's actor as a job builds it (with a token); buffer and trainer skip on_start, which would
    talk to a router and a buffer that are not there (what is fuzzed is the receiving path, the same)."""
    from vime.roles import resolve_role

    tls = spec.get("tls") or {}
    role = "rollout" if spec["kind"] == "http" else spec["role"]
    settings = ActorSettings(name=role, listen=listen_address(spec["transport"], Path(spec["run_dir"]), role),
                             token=TOKEN, run_dir=spec["run_dir"], max_message_bytes=MAX_MESSAGE_BYTES,
                             tls_cert_key=tls.get("cert_key"), tls_ca=tls.get("ca"))
    cls = resolve_role(role, allow_import=False)
    if role not in STARTED_ROLES:
        cls = type(cls.__name__, (cls,), {"on_start": _no_start})
    config = json.loads(Path(spec["config"]).read_text())
    actor = cls(settings, config)
    if role == "trainer":  # what its skipped on_start builds: the engine its handlers and on_stop use
        actor.build()
    return actor


async def _no_start(self: Actor) -> None:
    """on_start of an actor fuzzed alone: nothing to start."""


def child_main(spec_json: str) -> None:
    """``--child SPEC``: serve one target and write where to reach it to SPEC's ``ready`` file; an actor
    stops gracefully on SIGTERM (the driver of a join target simply dies: it has started nothing)."""
    spec = {**json.loads(spec_json), "signals": True}
    configure("warning")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            facts = await nursery.start(serve_target, spec)
            facts.pop("stop")
            Path(spec["ready"]).write_text(json.dumps(facts))  # (written whole: the parent reads it once not empty)

    trio.run(run)


# ------------------------------------------------------------------ the fuzzer's side


def rss_kib(pid: int) -> int:
    """Resident memory of ``pid`` in KiB, from /proc (0 where /proc has no such line)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:  # gone
        return 0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextlib.asynccontextmanager
async def probe(address: str, name: str, tls: dict[str, str] | None, folder: Path) -> AsyncIterator[Actor]:
    """A well-behaved client actor, with the job's token and certificates, that can ask the target; replies
    must come from the name asked, so the target's (``name``) is kept as ``client.target``."""
    transport = address.partition("://")[0]
    client = Actor(ActorSettings(name="prober", listen=listen_address(transport, folder, "prober"), token=TOKEN,
                                 tls_cert_key=(tls or {}).get("cert_key"), tls_ca=(tls or {}).get("ca")))
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: client.serve(handle_signals=False, task_status=task_status))
        client.directory[name] = address
        client.target = name
        try:
            yield client
        finally:
            client.stop()


async def status_of(client: Actor) -> Any | None:
    """The target's Status, or None when it does not answer within 30 s."""
    try:
        return await client.ask(client.target, StatusQuery(), timeout=30.0)
    except (TimeoutError, RuntimeError):
        return None


def push_socket(address: str, tls: dict[str, str] | None) -> pynng.Push0:
    """A raw nng socket to the target: frames go as they are, with no runtime to tidy them."""
    sock = pynng.Push0(send_timeout=10_000, send_buffer_size=64)
    if tls:
        sock.tls_config = TlsFiles(tls["cert_key"], tls["ca"]).config("127.0.0.1")
    sock.dial(address, block=True)
    return sock


def raw_connection(address: str, rng: random.Random) -> None:
    """Connect below nng (a plain TCP or Unix socket) and send what is no handshake, then hang up."""
    import socket

    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = rest
    else:
        conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        host, _, port = rest.rpartition(":")
        target = (host, int(port))
    conn.settimeout(2.0)
    with contextlib.suppress(OSError), conn:
        conn.connect(target)
        choice = rng.randrange(3)
        if choice == 0:
            conn.sendall(rng.randbytes(rng.randint(1, 4096)))
        elif choice == 1:  # an SP header that claims a huge message
            conn.sendall(b"\x00SP\x00\x00\x51\x00\x00" + (1 << 62).to_bytes(8, "big") + rng.randbytes(64))
        else:  # a TLS ClientHello's first bytes, then garbage
            conn.sendall(b"\x16\x03\x01\x02\x00" + rng.randbytes(512))


def fuzz_frames(address: str, tls: dict[str, str] | None, seed: str, frames: int, deadline: float,
                counts: dict[str, int], join: bool = False) -> None:
    """Send up to ``frames`` attack frames (in a thread: nng's send blocks when the actor pushes back);
    ``join``: every other one a stranger's Register."""
    rng = random.Random(seed)
    sock = push_socket(address, tls)
    oversized = bytes(4 * MAX_MESSAGE_BYTES + (17 << 20))
    try:
        for index in range(frames):
            if time.monotonic() > deadline:
                counts["stopped_by_time_limit"] = 1
                break
            if index % 997 == 0:
                raw_connection(address, rng)
                counts["raw_connections"] += 1
            if index % 20011 == 20010:
                data = oversized
            elif join and index % 2:
                data = register_frame(rng, index)
            else:
                data = attack(rng, index, wire=True)
            try:
                sock.send(data)
            except pynng.Timeout:  # the actor reads nothing for 10 s: twice in a row, it is gone or stuck
                counts["send_timeouts"] += 1
                if counts["send_timeouts"] >= 2:
                    break
                continue
            counts["send_timeouts"] = 0
            counts["sent"] += 1
    finally:
        sock.close()


def register_frame(rng: random.Random, index: int) -> bytes:
    """A Register that a stranger could send: wrong token, or the right one with broken fields."""
    fields = {"name": "joiner", "role": "rollout", "address": "tcp://127.0.0.1:9", "pid": 1, "host": "h"}
    choice = rng.randrange(4)
    if choice == 0:
        return frame(Register(**fields), rng.choice(["wrong", None]), index)
    name = rng.choice(sorted(fields))
    wrong = rng.choice([None, 1.5, [1], {"a": 1}, b"\x00", True, "7" if name == "pid" else 7])
    if name == "name" and rng.random() < 0.3:
        wrong = ""
    elif name == "address" and rng.random() < 0.5:  # a string, but nothing the driver could dial
        wrong = rng.choice(["", "x" * 300, "tcp://[::1", "tls+tcp://a:b", "ipc://", "ws://h:1"])
    return frame(Register(**fields), TOKEN, index, fields={**fields, name: wrong})


async def real_request(kind: str, client: Actor, url: str | None) -> bool:
    """A request a healthy target answers: a registration for the driver, a claim over HTTP, else Status."""
    if kind == "join":
        register = Register(name=f"joiner-{random.getrandbits(32):x}", role="rollout", address=client.address,
                            pid=os.getpid(), host="fuzz")
        try:
            return isinstance(await client.ask(client.target, register, timeout=30.0), Registered)
        except (TimeoutError, RuntimeError):
            return False
    if kind == "http":
        return await claim(url) is not None
    return await status_of(client) is not None


async def run_target(spec: dict[str, Any], serve: Callable[..., Any], frames: int, limit_s: float,
                     folder: Path) -> Result:
    """Start the target with ``serve`` (a child process or a task), fuzz it, and collect its figures."""
    result = Result(target_name(spec))
    started = time.monotonic()
    async with serve(spec) as facts:
        tls, pid = spec.get("tls"), facts["pid"]
        async with probe(facts["address"], facts["name"], tls, folder) as client:
            own_sends = client.counters["sent"]
            before = await status_of(client)
            http = None
            if spec["kind"] == "http":
                await client.tell(client.target, example_group(group_size=8))
                http = HttpFuzz(facts["url"], random.Random(f"http-{spec['seed']}"))
                await http.warm_up()
            result.rss_before_kib = rss_kib(pid)
            deadline = time.monotonic() + limit_s
            if http is not None:
                await fuzz_http(http, frames, deadline, loris_wait_s=READ_TIMEOUT_S + 5)
                result.sent, result.accepted, result.detail = http.sent, http.accepted, http.summary()
                result.stopped_by_time_limit = http.stopped_by_time_limit
            else:
                counts = dict.fromkeys(("sent", "raw_connections", "stopped_by_time_limit", "send_timeouts"), 0)
                sending = time.monotonic()
                await trio.to_thread.run_sync(fuzz_frames, facts["address"], tls, f"{result.target}-{spec['seed']}",
                                              frames, deadline, counts, spec["kind"] == "join")
                result.detail["sending_s"] = round(time.monotonic() - sending, 2)
                result.sent, result.raw_connections = counts["sent"], counts["raw_connections"]
                result.stopped_by_time_limit = bool(counts["stopped_by_time_limit"])
                result.detail["send_timeouts"] = counts["send_timeouts"]
            await settle(client)
            result.serving_after = await real_request(spec["kind"], client, facts.get("url"))
            own_sends = client.counters["sent"] - own_sends
            after = await status_of(client)
            result.rss_after_kib = rss_kib(pid)
            count_errors(result, before, after, own_sends, http is not None)
    if "exit_code" in facts:
        result.serving_after = False
        result.detail.update(died_with=facts["exit_code"], log_tail=facts["log_tail"])
        print(f"{result.target} DIED with {facts['exit_code']}:\n{facts['log_tail']}", file=sys.stderr)
    result.seconds = round(time.monotonic() - started, 2)
    return result


def target_name(spec: dict[str, Any]) -> str:
    return "http" if spec["kind"] == "http" else f"{spec.get('role', 'join')}/{spec['transport']}"


async def settle(client: Actor, quiet_s: float = 1.0, limit_s: float = 60.0) -> None:
    """Wait until the target has read what was sent: its frame count moves by no more than our own queries
    for ``quiet_s``."""
    seen, since = -1, time.monotonic()
    with trio.move_on_after(limit_s):
        while True:
            status = await status_of(client)
            if status is None:
                return
            frames_in = status.counters.get("frames_in", 0)
            if frames_in > seen + 1:
                since = time.monotonic()
            seen = frames_in
            if time.monotonic() - since > quiet_s:
                return
            await trio.sleep(0.25)


def count_errors(result: Result, before: Any, after: Any, own_sends: int, http: bool) -> None:
    """Accepted and errors as the target counts them, between two Status answers.

    A Status is computed while its own query is handled, so the messages handled between the two are
    exactly what the prober sent before the second query (``own_sends``: queries, the registration, the
    HTTP target's group) plus any garbage that got through.
    """
    if before is None or after is None:
        result.accepted = -1  # unknown: the target did not answer
        return
    def grown(then: dict[str, int], now: dict[str, int], prefix: str = "") -> dict[str, int]:
        return {k: v - then.get(k, 0) for k, v in sorted(now.items()) if k.startswith(prefix) and v > then.get(k, 0)}

    if http:  # the HTTP server counts into the worker's counters
        result.errors = grown(before.counters, after.counters, "http_")
        result.read_by_actor = result.errors.pop("http_requests", 0)
        return
    result.errors = grown(before.errors, after.errors)
    result.read_by_actor = after.counters.get("frames_in", 0) - before.counters.get("frames_in", 0) - own_sends
    result.accepted = after.counters.get("handled", 0) - before.counters.get("handled", 0) - own_sends


@contextlib.asynccontextmanager
async def child_process(spec: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The target in a child process of its own (logs to RUN_DIR/target.log), stopped at the end; a target
    that died meanwhile leaves its exit code and the end of its log in the facts."""
    ready = Path(spec["run_dir"]) / "ready.json"
    log_path = Path(spec["run_dir"]) / "target.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, __file__, "--child", json.dumps({**spec, "ready": str(ready)})],
                                   stdout=log, stderr=log)
    try:
        with trio.fail_after(180):
            while not ready.exists() or not ready.read_text():
                if process.poll() is not None:
                    raise RuntimeError(f"the target exited with {process.returncode}: {_tail(log_path)}")
                await trio.sleep(0.1)
        facts = json.loads(ready.read_text())
        yield facts
        if process.poll() is not None:
            facts.update(exit_code=process.returncode, log_tail=_tail(log_path))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def targets(selected: list[str] | None, folder: Path, configs: dict[str, str], tls: dict[str, str],
            seed: int) -> list[dict[str, Any]]:
    """Every target's spec: each role on each transport, the driver on each transport, the HTTP endpoint."""
    specs = [{"kind": "actor", "role": role, "transport": transport} for role in ROLES for transport in TRANSPORTS]
    specs += [{"kind": "join", "transport": transport} for transport in TRANSPORTS]
    specs.append({"kind": "http", "transport": "ipc"})
    out = []
    for spec in specs:
        name = target_name(spec)
        if selected and name not in selected:
            continue
        run_dir = folder / name.replace("/", "-").replace("+", "")
        run_dir.mkdir(parents=True, exist_ok=True)
        out.append({**spec, "run_dir": str(run_dir), "seed": seed, "tls": tls if "tls" in spec["transport"] else None,
                    "config": configs["http" if spec["kind"] == "http" else "actor"]})
    return out


def table(results: list[Result]) -> str:
    rows = ["| target | sent | read | accepted | errors counted | raw conns | serving after | RSS before MiB | "
            "RSS after MiB | s |", "| --- | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for r in results:
        errors = ", ".join(f"{k} {v:,}" for k, v in r.errors.items()) or "-"
        rows.append(f"| {r.target} | {r.sent:,} | {r.read_by_actor:,} | {r.accepted} | {errors} | {r.raw_connections} "
                    f"| {'yes' if r.serving_after else 'NO'} | {r.rss_before_kib / 1024:.1f} | "
                    f"{r.rss_after_kib / 1024:.1f} | {r.seconds:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Example: nice .venv/bin/python "
                                     "bench/fuzz.py --json bench/results/fuzz-cpu.json")
    parser.add_argument("--frames", type=int, default=100_000, help="frames (HTTP: requests) per target")
    parser.add_argument("--limit-s", type=float, default=300.0, help="each target stops sending after this long")
    parser.add_argument("--targets", default="", help="comma-separated names (buffer/tcp, join/ipc, http); all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    from transport import machine  # bench/transport.py: the same facts in every result file

    facts = machine()
    configure("error")  # the prober logs nothing worth reading here
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vime-fuzz-") as tmp:
        folder = Path(tmp)
        configs = prepare_configs(folder / "job")
        specs = targets([t for t in args.targets.split(",") if t], folder, configs, tls_files(folder / "tls"),
                        args.seed)
        results = []
        for spec in specs:
            result = trio.run(run_target, spec, child_process, args.frames, args.limit_s, folder)
            print(f"{result.target}: {result.sent:,} sent in {result.seconds:.0f} s", file=sys.stderr)
            results.append(result)
    wall_s = time.perf_counter() - started
    print(table(results), "", f"wall time {wall_s:.0f} s", sep="\n")
    if args.json:
        document = {"results": [dataclasses.asdict(r) for r in results], "frames_per_target": args.frames,
                    "limit_s": args.limit_s, "seed": args.seed, "machine": facts, "wall_s": round(wall_s, 1)}
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
