"""nng sockets for actors: one listening inbox each, one outbox per peer.

Every actor listens on a Pull0 socket (its *inbox*) and pushes to a peer's
inbox through a Push0 socket (an *outbox*). All traffic is one-way; a reply is
just a message addressed back, so no socket ever waits on a peer.

Why not pynng's ``arecv``/``asend``: each call allocates an nng aio and hops
through trio's thread token, about 220 us per round trip on our machines.
Here trio waits on nng's pollable descriptors (``recv_fd``/``send_fd``) and
the socket calls themselves never block. Messages are received as nng
messages whose buffer we own (``nng_recvmsg``), so tensors can view it with no
copy; the buffer is freed when the last view of it dies.

Addresses: ``ipc://PATH`` on one host, ``tcp://HOST:PORT`` across hosts
(port 0 picks a free one), ``tls+tcp://`` with a :class:`TlsFiles`.

nng dials quietly and retries for ever, so a peer that will never accept us
(it speaks TLS and we do not, or the reverse; a CA that does not match) looks
the same as one that is slow. :func:`probe_handshake` makes one connection
by hand first and says which it is.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import enum
import functools
import os
import re
import socket
import ssl
import time
from typing import Any
from urllib.parse import urlsplit

import pynng
import trio
from pynng import _nng

from vime.transports.codec import Encoded, frame_size, pack_meta, write_frame

_ffi, _lib = _nng.ffi, _nng.lib
_EAGAIN = _lib.NNG_EAGAIN
_NONBLOCK = _lib.NNG_FLAG_NONBLOCK


_RSA_KEY_OID = bytes.fromhex("06092a864886f70d010101")  # rsaEncryption, as a key's DER names its algorithm
_PEM_BLOCK = re.compile(r"-----BEGIN ([A-Z ]+)-----(.*?)-----END \1-----", re.S)


def rsa_key_problem(cert_key_file: str) -> str | None:
    """Why the key in ``cert_key_file`` cannot serve a listener: the mbedtls that pynng builds has no
    threading support (MBEDTLS_THREADING_C), and an RSA signature updates blinding values kept in the key,
    which nng shares across the handshakes it runs at once -- every actor is dialled by all its peers as a job
    starts. Once they are corrupted, every later handshake of that listener fails (BAD_SIGNATURE). Measured
    here: a listener dialled by 16 peers at once broke in 3 of 10 tries with a 2048-bit RSA key, in none of 40
    with ECDSA P-256 (which keeps no such state). An encrypted key is refused too: nothing here passes its
    password. None when the key is neither (or the file cannot be read: pynng then says what is wrong)."""
    try:
        stat = os.stat(cert_key_file)
    except OSError:
        return None
    return _key_problem(cert_key_file, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _key_problem(cert_key_file: str, mtime_ns: int, size: int) -> str | None:
    """:func:`rsa_key_problem` for one version of the file (a file replaced in place is read again)."""
    try:
        with open(cert_key_file, "rb") as pem:
            text = pem.read().decode("latin-1")
    except OSError:
        return None
    for label, body in _PEM_BLOCK.findall(text):
        if label == "ENCRYPTED PRIVATE KEY":
            return (f"{cert_key_file} holds an encrypted key, which vime cannot open (it takes no password): "
                    "write it without one (openssl pkey -in KEY -out PLAIN) and keep the file readable by you only")
        der = base64.b64decode("".join(body.split()), validate=False) if label == "PRIVATE KEY" else b""
        if label == "RSA PRIVATE KEY" or _RSA_KEY_OID in der[:32]:
            return (f"{cert_key_file} holds an RSA key, which vime's TLS (nng with mbedtls) corrupts when several "
                    "peers connect at once; make an ECDSA P-256 key, have the job's CA sign it, and pass the "
                    "certificate and key in one PEM: 'openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 "
                    "-nodes -keyout node.key -out node.csr -subj /CN=HOST', sign node.csr, then "
                    "'cat node.pem node.key > bundle.pem' (python -m vime.devtools.certificates DIR makes a test set)")
    return None


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files for ``tls+tcp://`` sockets: our certificate+key, and the CA that signs peers. ValueError for an
    RSA key (:func:`rsa_key_problem`)."""

    cert_key_file: str
    ca_file: str

    def __post_init__(self) -> None:
        problem = rsa_key_problem(self.cert_key_file)
        if problem:
            raise ValueError(problem)

    def config(self, server_name: str | None = None) -> pynng.TLSConfig:
        """Server side when ``server_name`` is None; else a client that checks the
        peer's certificate names ``server_name`` (the host it dials)."""
        mode = pynng.TLSConfig.MODE_SERVER if server_name is None else pynng.TLSConfig.MODE_CLIENT
        return pynng.TLSConfig(
            mode,
            server_name=server_name,
            ca_files=[self.ca_file],
            cert_key_file=self.cert_key_file,
            auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
        )


class Handshake(enum.Enum):
    """What :func:`probe_handshake` found at a peer's address."""

    OK = "ok"
    UNREACHABLE = "nothing answers there (yet)"
    PEER_WANTS_TLS = "the peer closed the connection at once: it expects TLS"
    PEER_NOT_TLS = "the peer does not speak TLS"
    PEER_UNTRUSTED = "the peer's certificate is not trusted by our CA"
    WE_ARE_REFUSED = "the peer did not accept our certificate"


_SP_HEADER = b"\x00SP\x00"  # how every nng (SP) connection starts, both ways
_PUSH0 = b"\x00\x50\x00\x00"  # protocol Push0, as our outboxes dial


def probe_handshake(address: str, tls: TlsFiles | None, timeout: float = 5.0) -> tuple[Handshake, str]:
    """Connect to a ``tcp://`` or ``tls+tcp://`` address once, as an outbox would, and say how it went.

    Returns the finding and the detail the TLS library gave. A peer that is not
    listening yet is UNREACHABLE: the caller may still wait for it.
    """
    url = urlsplit(address)
    try:
        raw = socket.create_connection((url.hostname, url.port), timeout=timeout)
    except OSError as err:
        return Handshake.UNREACHABLE, str(err)
    with raw:
        if url.scheme == "tls+tcp":
            assert tls is not None, "a tls+tcp address needs TLS files"
            return _probe_tls(raw, url.hostname, tls)
        return _probe_sp(raw, Handshake.PEER_WANTS_TLS)


def _probe_tls(raw: socket.socket, server_name: str, tls: TlsFiles) -> tuple[Handshake, str]:
    """The TLS handshake, then the SP header: a peer that refuses our certificate says so only after
    the handshake, by dropping the connection."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(tls.ca_file)
    context.load_cert_chain(tls.cert_key_file)
    try:
        wrapped = context.wrap_socket(raw, server_hostname=server_name)
    except ssl.SSLCertVerificationError as err:
        return Handshake.PEER_UNTRUSTED, err.verify_message
    except ssl.SSLError as err:
        return Handshake.PEER_NOT_TLS, err.reason or str(err)
    except OSError as err:
        return Handshake.PEER_NOT_TLS, str(err)
    return _probe_sp(wrapped, Handshake.WE_ARE_REFUSED)


def _probe_sp(connection: socket.socket, if_dropped: Handshake) -> tuple[Handshake, str]:
    """Send our SP header and read the peer's; a dropped connection is ``if_dropped``."""
    try:
        connection.sendall(_SP_HEADER + _PUSH0)
        answer = connection.recv(len(_SP_HEADER))
    except TimeoutError as err:  # slow, not refusing: the caller waits as usual
        return Handshake.UNREACHABLE, str(err)
    except (ssl.SSLError, OSError) as err:
        return if_dropped, str(err)
    if answer.startswith(_SP_HEADER):
        return Handshake.OK, ""
    return if_dropped, f"it answered {answer[:8]!r}"


def _check(rv: int) -> None:
    if rv:
        pynng.exceptions.check_err(rv)


def _tasks_runnable() -> int:
    """How many trio tasks wait to run, read from the run queue itself.

    ``trio.lowlevel.current_statistics()`` answers the same but also walks
    every registered descriptor: about 4 us, called twice per round trip.
    The run queue is private to trio, so any other trio layout falls back
    to the public call.
    """
    try:
        return len(trio._core._run.GLOBAL_RUN_CONTEXT.runner.runq)
    except AttributeError:
        return trio.lowlevel.current_statistics().tasks_runnable


class Inbox:
    """The listening socket of one actor; hands out whole frames as owned buffers."""

    def __init__(
        self,
        address: str,
        *,
        max_frame_bytes: int = 2 << 30,
        tls: TlsFiles | None = None,
    ) -> None:
        self._sock = pynng.Pull0(recv_max_size=max_frame_bytes)
        if address.startswith("tls+") and tls is None:
            raise ValueError(f"{address} needs TLS files (--tls-cert-key, --tls-ca)")
        if tls is not None:
            self._sock.tls_config = tls.config()
        listener = self._sock.listen(address)
        self.address = _bound_address(address, listener)
        self._fd = self._sock.recv_fd
        self._msg_p = _ffi.new("nng_msg **")  # reused: only the actor's trio thread receives

    def try_receive(self) -> Any | None:
        """A frame buffer if one is waiting, else None; never blocks."""
        msg_p = self._msg_p
        rv = _lib.nng_recvmsg(self._sock.socket, msg_p, _NONBLOCK)
        if rv == _EAGAIN:
            return None
        _check(rv)
        msg = msg_p[0]
        size = _lib.nng_msg_len(msg)
        body = _ffi.gc(_ffi.cast("char *", _lib.nng_msg_body(msg)), lambda _, m=msg: _lib.nng_msg_free(m))
        return _ffi.buffer(body, size)

    async def receive(self) -> Any:
        """Wait for the next frame, parking on nng's descriptor when none is waiting.

        When a frame is already waiting it returns without yielding to other
        tasks (only a pending cancellation is honoured): one scheduling pass
        per message is a measurable share of a local round trip. Callers that
        loop over it must yield elsewhere.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while (buffer := self.try_receive()) is None:
            await trio.lowlevel.wait_readable(self._fd)
        return buffer

    def poll(self, spin_s: float) -> Any | None:
        """Poll for a frame for up to ``spin_s``, unless another trio task is runnable.

        Checking once is enough: while this thread polls, the scheduler does
        not run, so no task can become runnable. Between polls the CPU is
        yielded, so nng's own threads -- which move the bytes -- are never starved.
        """
        if _tasks_runnable():
            return None
        deadline = time.perf_counter() + spin_s
        while time.perf_counter() < deadline:
            os.sched_yield()
            buffer = self.try_receive()
            if buffer is not None:
                return buffer
        return None

    def close(self) -> None:
        self._sock.close()


def _bound_address(address: str, listener: pynng.Listener) -> str:
    """The address peers should dial: tcp port 0 replaced by the port nng chose."""
    scheme, _, rest = address.partition("://")
    if "tcp" not in scheme:
        return address
    host, _, port = rest.rpartition(":")
    if port == "0":
        port = str(socket.ntohs(listener.local_address.port))  # pynng reports network byte order
    return f"{scheme}://{host}:{port}"


class Outbox:
    """A Push0 socket to one peer, with a bounded queue drained by :meth:`pump`.

    ``put_nowait`` queues without yielding, so a burst of sends piles up and
    the pump ships it as a few large frames instead of many small ones; when
    the queue is full, ``put`` waits (backpressure reaches the sender). Frames
    wait in the queue while the peer is not connected yet.
    """

    def __init__(
        self,
        address: str,
        reply_address: str,
        token: str | None,
        *,
        capacity: int = 1024,
        max_frame_bytes: int = 1 << 20,
        tls: TlsFiles | None = None,
    ) -> None:
        self.address = address
        if tls is None and address.startswith("tls+"):
            raise ValueError(f"{address} needs TLS files (--tls-cert-key, --tls-ca)")
        server_name = urlsplit(address).hostname if tls is not None else None  # ValueError for a malformed one
        # nng buffers whole frames: keep few, so a slow peer pushes back on tell() soon.
        self._sock = pynng.Push0(send_buffer_size=8)
        try:  # an address nng refuses must not leave the socket open (strangers' reply addresses are made up)
            if tls is not None:
                self._sock.tls_config = tls.config(server_name)
            self._sock.dial(address, block=False)
        except BaseException:
            self._sock.close()
            raise
        self._fd = self._sock.send_fd
        self._reply_address = reply_address
        self._token = token
        self._single_meta = pack_meta(reply_address, token, 1)  # most frames carry one message
        self._msg_p = _ffi.new("nng_msg **")
        self._max_frame_bytes = max_frame_bytes
        self._unshipped = 0
        self._send_queue, self._queue = trio.open_memory_channel[Encoded](capacity)

    @property
    def connected(self) -> bool:
        return bool(self._sock.pipes)

    def put_nowait(self, message: Encoded) -> None:
        """Queue a message; raises trio.WouldBlock when the queue is full."""
        self._send_queue.send_nowait(message)
        self._unshipped += 1

    async def put(self, message: Encoded) -> None:
        """Queue a message, waiting for room when the queue is full."""
        try:
            self._send_queue.send_nowait(message)
        except trio.WouldBlock:
            await self._send_queue.send(message)
        self._unshipped += 1

    @property
    def queued(self) -> int:
        """Messages accepted but not yet handed to nng (the channel's count misses
        one that went straight to the waiting pump, hence our own)."""
        return self._unshipped

    def send_now(self, message: Encoded) -> bool:
        """Ship one message at once, skipping the queue, if that keeps order.

        For latency-bound traffic (asks and replies): it saves the hop through
        the pump task. Returns False when the message must be queued instead
        (others are waiting, or nng cannot take it without blocking).
        """
        if self._unshipped:
            return False
        msg = self._frame([message])
        rv = _lib.nng_sendmsg(self._sock.socket, msg, _NONBLOCK)
        if rv:
            _lib.nng_msg_free(msg)
            if rv != _EAGAIN:
                _check(rv)
            return False
        return True

    async def pump(self) -> None:
        """Ship queued messages, batching whatever is waiting, until closed.

        Returns quietly when the outbox is closed under it (its peer died):
        what was still queued is dropped, which is what close() promises.
        """
        try:
            await self._pump()
        except (trio.ClosedResourceError, pynng.Closed):
            pass

    async def _pump(self) -> None:
        async for first in self._queue:
            batch, size = [first], first.size
            while size < self._max_frame_bytes:
                try:
                    message = self._queue.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                batch.append(message)
                size += message.size
            await self._ship(self._frame(batch))
            self._unshipped -= len(batch)

    def _frame(self, batch: list[Encoded]) -> Any:
        """An nng message holding ``batch`` as one frame (caller owns it)."""
        meta = self._single_meta if len(batch) == 1 else pack_meta(self._reply_address, self._token, len(batch))
        size = frame_size(meta, batch)
        msg_p = self._msg_p
        _check(_lib.nng_msg_alloc(msg_p, size))
        msg = msg_p[0]
        try:
            write_frame(memoryview(_ffi.buffer(_lib.nng_msg_body(msg), size)), meta, batch)
        except BaseException:
            _lib.nng_msg_free(msg)
            raise
        return msg

    async def _ship(self, msg: Any) -> None:
        try:
            while (rv := _lib.nng_sendmsg(self._sock.socket, msg, _NONBLOCK)) == _EAGAIN:
                await trio.lowlevel.wait_readable(self._fd)
        except BaseException:
            _lib.nng_msg_free(msg)
            raise
        if rv:
            _lib.nng_msg_free(msg)
            _check(rv)

    def close(self) -> None:
        """Stop the pump; anything still queued is dropped (the peer is gone).

        Senders waiting for room get trio.ClosedResourceError.
        """
        self._send_queue.close()
        self._queue.close()
        with contextlib.suppress(RuntimeError):  # outside a trio run nobody can be waiting on it
            trio.lowlevel.notify_closing(self._fd)
        self._sock.close()
