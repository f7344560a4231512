"""Requests an attacker (or a broken agent) could send the OpenAI-compatible endpoint, for bench/fuzz.py and the tests.

Families, in turn: random bytes; malformed request lines and headers (bad versions, negative or doubled
Content-Length, broken chunked bodies, control bytes); huge headers (one of up to 1 MiB, or thousands);
invalid JSON; bodies that are JSON but no object; a wrong type in one field of every route's body
(``messages``, ``model``, ``stream``, ``max_tokens`` ... of a completion, ``reward`` of an end); unknown
routes, methods and episode ids; bodies cut short (the client hangs up mid-body). Every one is garbage:
a 2xx answer to it counts as accepted. Beside them, now and then a real streaming completion whose
client vanishes after the first chunk, and, held open for the whole run, slow-loris connections that
send part of a body and then nothing: the server must close them at its read deadline.

Each request opens its own connection, sends, half-closes, and reads the answer until the server
closes (10 s at most).
"""

from __future__ import annotations

import collections
import json
import random
import socket
import struct
import time
from typing import Any
from urllib.parse import urlsplit

import trio

TASK = [{"role": "user", "content": "1+5="}]
COMPLETION_FIELDS: dict[str, list[Any]] = {
    "messages": ["hi", 5, None, [1], ["x"], [{"content": "x"}], [{"role": 5, "content": "x"}],
                [{"role": "user", "content": 5}], [{"role": "user", "content": [5]}],
                [{"role": "alien", "content": "x"}], []],
    "model": [5, [], {}, True],
    "stream": ["yes", 1, [], {}],
    "logprobs": ["yes", 2, [], {}],
    "max_tokens": ["3", 1.5, True, [], {}, -1, 0],
    "max_completion_tokens": ["3", 2.5, False, [], -7],
    "n": ["1", 1.0, True, [], 2],
    "temperature": ["hot", True, [], {}, 0.3],
    "top_p": ["x", False, [], 0.5],
    "tools": ["x", 5, [5], {"a": 1}, [{"type": 5}]],
}
END_FIELDS: dict[str, list[Any]] = {"reward": ["1", True, [], {}, float("nan"), float("inf"), "NaN"]}
MALFORMED = [
    b"GET / HTTP/9.9\r\nhost: x\r\n\r\n", b"POST /episodes HTTP/1.1\r\n\r\n", b"\r\n\r\n", b"POST\r\n\r\n",
    b"POST /episodes HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n",
    b"POST /episodes HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
    b"POST /episodes HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /episodes HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n{}",
    b"POST /episodes HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", b"POST /episodes HTTP/1.1\r\nhost: \x00\x01\r\n\r\n",
    b"POST /\xff\xfe HTTP/1.1\r\nhost: x\r\n\r\n", b"PO ST / HTTP/1.1\r\nhost: x\r\n\r\n",
    b"POST /episodes HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999999999999\r\n\r\n{}",
]


def request(method: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: fuzz", f"content-length: {len(body)}",
             *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(host: str, port: int, data: bytes, *, read: bool = True, vanish_after: int = 0) -> int | None:
    """Send ``data`` on a new connection; the answer's status (None: closed without one). ``vanish_after``:
    hang up once that many bytes of the answer came (a streaming client that goes away)."""
    with trio.move_on_after(10):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            try:
                await stream.send_all(data)
                if not vanish_after:
                    await stream.send_eof()
                answer = bytearray()
                while read and (chunk := await stream.receive_some(65536)):
                    answer += chunk
                    if vanish_after and len(answer) >= vanish_after:
                        break
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if answer.startswith(b"HTTP/1.1 ") and answer[9:12].isdigit():
                return int(answer[9:12])
    return None


async def hang_up(host: str, port: int, data: bytes, *, after: bytes | None, wait_s: float = 0.0, reset: bool = False,
                  read_all: bool = False) -> bytes:
    """Send ``data`` on a new connection and leave once ``after`` has come (None: at once), ``wait_s`` later, with a
    reset (SO_LINGER 0) or a plain close; or, ``read_all``, read until the server closes. What was received."""
    received = b""
    with trio.fail_after(60):
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(data)
            while (read_all or (after is not None and after not in received)) and (
                    chunk := await stream.receive_some(65536)):
                received += chunk
            await trio.sleep(wait_s)
            if reset:
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return received


async def claim(url: str) -> dict[str, Any] | None:
    """POST /episodes (a real agent's first call); the answer, or None when none came."""
    parts = urlsplit(url)
    with trio.move_on_after(10):
        stream = await trio.open_tcp_stream(parts.hostname, parts.port)
        async with stream:
            await stream.send_all(request("POST", "/episodes", b"{}", {"connection": "close"}))
            answer = bytearray()
            while chunk := await stream.receive_some(65536):
                answer += chunk
            head, _, body = bytes(answer).partition(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 200"):
                return json.loads(body)
    return None


class HttpFuzz:
    """One HTTP target's fuzzer: what it sent and how the server answered."""

    def __init__(self, url: str, rng: random.Random, slow_loris: int = 16) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.rng = rng
        self.slow_loris = slow_loris
        self.episodes: list[str] = []  # claimed: completions and ends are fuzzed on them
        self.streams: list[dict[str, Any]] = []  # claimed for streaming clients that vanish
        self.statuses: collections.Counter[str] = collections.Counter()
        self.sent = self.accepted = self.vanished = 0
        self.stopped_by_time_limit = False
        self.loris_closed = 0
        self._loris: list[trio.SocketStream] = []

    async def warm_up(self) -> None:
        """Claim the episodes to fuzz on (two for completions and ends, four for vanishing streams), open
        the slow-loris connections, and run one vanishing stream."""
        for _ in range(60):
            task = await claim(f"http://{self.host}:{self.port}")
            if task is not None and task["id"] is not None:
                (self.episodes if len(self.episodes) < 2 else self.streams).append(task["id"])
                if len(self.streams) == 4:
                    break
            else:
                await trio.sleep(0.25)  # the worker offers the group's episodes once it has handled the group
        self.streams = [{"id": e, "messages": list(TASK), "done": False} for e in self.streams]
        await self.vanish()  # the engine's first generation allocates for good: before the RSS is read
        for index in range(self.slow_loris):
            await self._open_loris(index)

    async def _open_loris(self, index: int) -> None:
        stream = await trio.open_tcp_stream(self.host, self.port)
        body = b'{"messages": ['
        if index % 2:  # stops inside the head
            await stream.send_all(b"POST /episodes HTTP/1.1\r\nhost: fuzz\r\nx-slow: ")
        else:  # stops inside the body
            await stream.send_all(request("POST", "/episodes", body + b" " * 1000)[:-1000])
        self._loris.append(stream)

    async def check_loris(self) -> None:
        """Count the slow-loris connections the server has closed (reading gives EOF or a reset)."""
        for stream in self._loris:
            with trio.move_on_after(0.5):
                try:
                    while await stream.receive_some(65536):
                        pass
                except trio.BrokenResourceError:
                    pass
                self.loris_closed += 1
            await stream.aclose()

    def garbage(self, index: int) -> tuple[str, bytes]:
        """Request number ``index``: its family's name and its bytes (the families take turns)."""
        rng = self.rng
        episode = rng.choice(self.episodes) if self.episodes else "0" * 32
        completions = f"/episodes/{episode}/v1/chat/completions"
        family = index % 9
        if family == 0:
            return "random-bytes", rng.randbytes(rng.randint(1, 2000))
        if family == 1:
            return "malformed", rng.choice(MALFORMED)
        if family == 2:  # over h11's 16 KiB limit on a request's head
            if rng.random() < 0.5:
                return "huge-head", request("POST", "/episodes", b"{}", {"x-big": "a" * rng.choice([70_000, 1 << 20])})
            many = {f"x-h{i}": "v" * 8 for i in range(rng.choice([2000, 20_000]))}
            return "huge-head", request("POST", "/episodes", b"{}", many)
        if family == 3:
            return "invalid-json", request("POST", rng.choice([completions, "/episodes"]), rng.choice(
                [b"{", b"{'a': 1}", b'{"messages": [}', b"\xff\xfe", b"nul", b"[" * 100_000, b'{"a": ' * 50_000]))
        if family == 4:
            body = json.dumps(rng.choice([[], 5, "s", None, [{"role": "user"}]])).encode()
            return "not-an-object", request("POST", completions, body)
        if family in (5, 6):
            name = rng.choice(sorted(COMPLETION_FIELDS))
            fields: dict[str, Any] = {"model": "m", "messages": TASK, name: rng.choice(COMPLETION_FIELDS[name])}
            return f"wrong-{name}", request("POST", completions, json.dumps(fields).encode())
        if family == 7:
            value = rng.choice(END_FIELDS["reward"])
            return "wrong-reward", request("POST", f"/episodes/{episode}/end", json.dumps({"reward": value}).encode())
        route = rng.choice([("GET", "/episodes"), ("POST", "/"), ("DELETE", completions), ("POST", "/episodes/x/end"),
                            ("POST", f"/episodes/{'f' * 32}/end"), ("POST", "/episodes/" + "a" * 5000)])
        whole = request(*route, b"{}")
        return ("cut-short", whole[: rng.randrange(len(whole))]) if rng.random() < 0.3 else ("bad-route", whole)

    async def vanish(self) -> None:
        """A real streaming completion whose client hangs up after the first chunk."""
        open_streams = [s for s in self.streams if not s["done"]]
        if not open_streams:
            return
        episode = self.rng.choice(open_streams)
        body = {"model": "m", "messages": episode["messages"], "stream": True, "max_tokens": 2}
        status = await exchange(self.host, self.port, request("POST", f"/episodes/{episode['id']}/v1/chat/completions",
                                                              json.dumps(body).encode()), vanish_after=1)
        self.statuses[f"vanishing-stream {status}"] += 1  # (a 500 here is a server failure like any other)
        if status == 200:  # it streamed, then its client vanished: only such a stream counts as vanished
            self.vanished += 1
            # The next turn repeats the conversation (an assistant's text need not match).
            episode["messages"] = [*episode["messages"], {"role": "assistant", "content": ""},
                                   {"role": "user", "content": "and?"}]
        elif status == 400:  # the episode is full
            episode["done"] = True

    def summary(self) -> dict[str, Any]:
        return {"statuses": dict(sorted(self.statuses.items())), "vanished_streams": self.vanished,
                "slow_loris_opened": len(self._loris), "slow_loris_closed_by_server": self.loris_closed}


async def fuzz_http(fuzz: HttpFuzz, requests: int, deadline: float, workers: int = 8,
                    loris_wait_s: float = 0.0) -> None:
    """Send up to ``requests`` garbage requests from ``workers`` connections at a time, a vanishing stream
    every 500th; then wait until ``loris_wait_s`` after the start and count the slow-loris connections closed."""
    started = time.monotonic()
    indices = iter(range(requests))

    async def worker() -> None:
        for index in indices:
            if time.monotonic() > deadline:
                fuzz.stopped_by_time_limit = True
                return
            if index % 500 == 499:
                await fuzz.vanish()
            family, data = fuzz.garbage(index)
            status = await exchange(fuzz.host, fuzz.port, data)
            fuzz.sent += 1
            fuzz.statuses[f"{family} {status}"] += 1
            if status is not None and status < 300:
                fuzz.accepted += 1

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
    await trio.sleep(max(0.0, started + loris_wait_s - time.monotonic()))
    await fuzz.check_loris()
