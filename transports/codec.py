"""The wire format: msgpack headers with tensors framed beside them as raw bytes.

One frame (one nng message) carries one or more messages from one sender::

    b"VIM1" | u32 meta_len | meta | message*
    message = u32 header_len | u64 raw_len | header | zeros to a 64-byte boundary | raw

``meta`` is msgpack ``[reply_address, token, count]``. ``header`` is the
msgpack envelope ``[kind, sender, receiver, id, reply_to, sent_at,
weight_version, wants_reply, fields]``. Tensors and arrays inside ``fields``
become msgpack ext values (code 1) that describe where their bytes lie: in
``raw`` (at an offset, 64-byte aligned) or in a shared-memory segment. msgpack
would copy bin/ext payloads on unpack, which is why the bytes live outside it:
the receiver builds tensors that *view* the frame buffer, so the buffer's owner
must stay alive as long as they do (callers pass a buffer that does).

Only msgpack is parsed; dtype names are looked up in fixed tables; nothing
received is ever unpickled, evaluated or imported.

torch is imported by the first torch tensor decoded, not before: actors whose
messages carry none (the router, the reward actor) never pay for it.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import TYPE_CHECKING, Any, Callable

import msgpack
import numpy as np

from vime.transports.records import SchemaError, build, is_record, is_tensor, kind_of, to_fields

if TYPE_CHECKING:
    import torch

MAGIC = b"VIM1"
_PREAMBLE = struct.Struct("<4sI")
_MESSAGE_HEAD = struct.Struct("<IQ")
_ALIGN = 64
_ZEROS = bytes(_ALIGN)
_TENSOR_EXT = 1

TORCH_DTYPE_NAMES = frozenset((
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32",
    "int64", "uint8", "bool", "complex64",
))  # each the name of a torch dtype: getattr(torch, name)
NUMPY_DTYPES = {
    name: np.dtype(name)
    for name in (
        "float32", "float64", "float16", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64", "bool", "complex64",
    )
}


class FrameError(ValueError):
    """The bytes are not a vime frame (garbage, truncated or foreign)."""


class OversizedError(ValueError):
    """A message is larger than the receiver accepts."""


@dataclasses.dataclass(slots=True)
class Envelope:
    """A message and its routing facts; ``payload`` is a record instance."""

    kind: str
    sender: str
    receiver: str
    id: int
    reply_to: int | None
    sent_at: float
    weight_version: int | None
    wants_reply: bool
    payload: Any


@dataclasses.dataclass(slots=True)
class BadMessage:
    """A message that arrived but could not be accepted, with what is known of it."""

    reason: str
    error: str
    kind: str | None = None
    sender: str | None = None
    id: int | None = None
    wants_reply: bool = False


@dataclasses.dataclass(slots=True)
class Frame:
    reply_address: str
    token: str | None
    messages: list[Envelope | BadMessage]


@dataclasses.dataclass(slots=True)
class Encoded:
    """One message ready to be framed: its header and the tensors to copy after it."""

    header: bytes
    tensors: list[tuple[memoryview, int]]  # (bytes, offset in raw)
    raw_len: int
    shm: list[tuple[str, memoryview]]  # segments written for this message: (name, bytes)

    @property
    def size(self) -> int:
        """Bytes this message adds to a frame, give or take alignment padding."""
        return _MESSAGE_HEAD.size + len(self.header) + _ALIGN + self.raw_len


ShmWriter = Callable[[memoryview], str]
ShmResolver = Callable[[str, int], Any]


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _raw_start(pos: int, header_len: int) -> int:
    """Where the raw block of a message starting at ``pos`` begins: aligned within the frame."""
    return _align(pos + _MESSAGE_HEAD.size + header_len)


def _as_bytes(value: torch.Tensor | np.ndarray) -> tuple[str, str, list[int], memoryview]:
    """(library, dtype name, shape, contiguous byte view) of a tensor or array."""
    if isinstance(value, np.ndarray):
        if value.dtype.name not in NUMPY_DTYPES:
            raise TypeError(f"array dtype {value.dtype} cannot travel; convert it to one of {sorted(NUMPY_DTYPES)}")
        flat = np.ascontiguousarray(value).reshape(-1)  # (ascontiguousarray makes 0-d arrays 1-d)
        return "numpy", value.dtype.name, list(value.shape), memoryview(flat.view(np.uint8))
    import torch  # imported already: value is a tensor

    tensor = value.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in TORCH_DTYPE_NAMES:
        raise TypeError(f"tensor dtype {tensor.dtype} cannot travel; convert it to one of {sorted(TORCH_DTYPE_NAMES)}")
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return "torch", dtype, list(tensor.shape), memoryview(flat.numpy())


def encode(envelope: Envelope, shm_writer: ShmWriter | None = None, shm_threshold: int = 1 << 20) -> Encoded:
    """Serialise one envelope; tensors of at least ``shm_threshold`` bytes go to
    shared memory through ``shm_writer`` when one is given (same-host peers)."""
    tensors: list[tuple[memoryview, int]] = []
    raw_len = 0
    shm: list[tuple[str, memoryview]] = []

    def default(value: Any) -> Any:
        nonlocal raw_len
        if is_record(value):
            return to_fields(value)
        if isinstance(value, np.ndarray) or is_tensor(value):
            library, dtype, shape, data = _as_bytes(value)
            if shm_writer is not None and data.nbytes >= shm_threshold:
                name = shm_writer(data)
                shm.append((name, data))
                ref = [library, dtype, shape, 0, data.nbytes, name]
            else:
                ref = [library, dtype, shape, raw_len, data.nbytes, None]
                tensors.append((data, raw_len))
                raw_len = _align(raw_len + data.nbytes)
            return msgpack.ExtType(_TENSOR_EXT, msgpack.packb(ref))
        raise TypeError(f"{type(value).__name__} cannot travel in a message; declare it as a record or use plain types")

    e = envelope
    header = msgpack.packb(
        [e.kind, e.sender, e.receiver, e.id, e.reply_to, e.sent_at, e.weight_version, e.wants_reply,
         to_fields(e.payload)],
        default=default,
    )
    return Encoded(header, tensors, raw_len, shm)


def frame_size(meta: bytes, messages: list[Encoded]) -> int:
    pos = _PREAMBLE.size + len(meta)
    for m in messages:
        pos = _raw_start(pos, len(m.header)) + m.raw_len
    return pos


def pack_meta(reply_address: str, token: str | None, count: int) -> bytes:
    return msgpack.packb([reply_address, token, count])


def write_frame(out: memoryview, meta: bytes, messages: list[Encoded]) -> None:
    """Fill ``out`` (exactly ``frame_size`` bytes) with the frame."""
    _PREAMBLE.pack_into(out, 0, MAGIC, len(meta))
    pos = _PREAMBLE.size
    out[pos : pos + len(meta)] = meta
    pos += len(meta)
    for m in messages:
        _MESSAGE_HEAD.pack_into(out, pos, len(m.header), m.raw_len)
        out[pos + _MESSAGE_HEAD.size : pos + _MESSAGE_HEAD.size + len(m.header)] = m.header
        raw = _raw_start(pos, len(m.header))
        out[pos + _MESSAGE_HEAD.size + len(m.header) : raw] = _ZEROS[: raw - pos - _MESSAGE_HEAD.size - len(m.header)]
        for data, offset in m.tensors:
            out[raw + offset : raw + offset + data.nbytes] = data
        pos = raw + m.raw_len


def encode_frame(reply_address: str, token: str | None, messages: list[Encoded]) -> bytearray:
    """A whole frame in a new buffer (tests, logs; sockets write into nng's own)."""
    meta = pack_meta(reply_address, token, len(messages))
    out = bytearray(frame_size(meta, messages))
    write_frame(memoryview(out), meta, messages)
    return out


def decode_frame(
    buffer: Any,
    *,
    max_message_bytes: int,
    resolve_shm: ShmResolver | None = None,
    token: str | None = None,
) -> Frame:
    """Parse a frame. Tensors view ``buffer`` (keep it alive while they live).

    Raises FrameError when the frame itself is unreadable; a bad message inside
    a readable frame becomes a BadMessage and the others are still delivered.
    With ``token`` given, a frame signed otherwise maps no shared memory: it is
    parsed only far enough to be refused.
    """
    view = memoryview(buffer).cast("B")
    if len(view) < _PREAMBLE.size:
        raise FrameError(f"frame of {len(view)} bytes is shorter than the {_PREAMBLE.size}-byte preamble")
    magic, meta_len = _PREAMBLE.unpack_from(view, 0)
    if magic != MAGIC:
        raise FrameError(f"not a vime frame (starts with {bytes(magic)!r}); "
                         "is the peer a vime actor of the same version?")
    pos = _PREAMBLE.size + meta_len
    if pos > len(view):
        raise FrameError("frame truncated inside its meta block")
    try:
        reply_address, frame_token, count = msgpack.unpackb(view[_PREAMBLE.size : pos])
        if not isinstance(reply_address, str) or not isinstance(count, int):
            raise TypeError("meta has wrong types")
    except Exception as err:
        raise FrameError(f"frame meta is malformed: {err}") from None
    if token is not None and frame_token != token:
        resolve_shm = None
    messages: list[Envelope | BadMessage] = []
    for _ in range(count):
        if pos + _MESSAGE_HEAD.size > len(view):
            messages.append(BadMessage("truncated", "frame ended before the next message header"))
            break
        header_len, raw_len = _MESSAGE_HEAD.unpack_from(view, pos)
        raw_start = _raw_start(pos, header_len)
        if raw_start + raw_len > len(view):
            messages.append(BadMessage("truncated", f"message claims {raw_start + raw_len - pos} bytes, "
                                                    f"only {len(view) - pos} remain"))
            break
        head = view[pos + _MESSAGE_HEAD.size : pos + _MESSAGE_HEAD.size + header_len]
        messages.append(_decode_message(buffer, head, raw_start, raw_len, max_message_bytes, resolve_shm))
        pos = raw_start + raw_len
    return Frame(reply_address, frame_token, messages)


def _decode_message(
    buffer: Any, head: memoryview, raw_start: int, raw_len: int, limit: int, resolve_shm: ShmResolver | None
) -> Envelope | BadMessage:
    shm_total = 0

    def ext_hook(code: int, data: bytes) -> Any:
        nonlocal shm_total
        if code != _TENSOR_EXT:
            raise SchemaError(f"unknown msgpack extension type {code}")
        library, dtype, shape, offset, nbytes, shm_name = msgpack.unpackb(data)
        if shm_name is None:
            if not 0 <= offset <= offset + nbytes <= raw_len:
                raise SchemaError(f"tensor bytes [{offset}, {offset + nbytes}) lie outside the message")
            return _view(library, dtype, shape, buffer, raw_start + offset, nbytes)
        shm_total += nbytes
        if shm_total + len(head) + raw_len > limit:
            raise OversizedError(f"shared-memory payload of {shm_total} bytes exceeds the {limit}-byte limit")
        if resolve_shm is None:
            raise SchemaError("tensor in shared memory, but this socket does not accept shared memory")
        return _view(library, dtype, shape, resolve_shm(shm_name, nbytes), 0, nbytes)

    envelope_fields: list[Any] | None = None
    try:
        if len(head) + raw_len > limit:
            # Still read the header, for a useful error reply, but not the tensors.
            envelope_fields = msgpack.unpackb(head, ext_hook=lambda code, data: None)
            raise OversizedError(f"message of {len(head) + raw_len} bytes exceeds the {limit}-byte limit")
        envelope_fields = msgpack.unpackb(head, ext_hook=ext_hook)
        return _envelope(envelope_fields)
    except (OversizedError, SchemaError, FrameError) as err:
        reason = {OversizedError: "oversized", SchemaError: "schema"}.get(type(err), "malformed")
        return _bad(reason, err, envelope_fields)
    except Exception as err:  # msgpack raises a zoo of types for garbage input
        return _bad("malformed", err, envelope_fields)


def _envelope(fields: Any) -> Envelope:
    if not isinstance(fields, list) or len(fields) != 9:
        raise FrameError("envelope is not a 9-item array")
    kind, sender, receiver, msg_id, reply_to, sent_at, weight_version, wants_reply, payload = fields
    if not (isinstance(kind, str) and isinstance(sender, str) and isinstance(receiver, str)
            and type(msg_id) is int and (reply_to is None or type(reply_to) is int)
            and isinstance(sent_at, (int, float)) and (weight_version is None or type(weight_version) is int)
            and type(wants_reply) is bool):
        raise FrameError("envelope fields have wrong types")
    record = build(kind_of(kind), payload)
    return Envelope(kind, sender, receiver, msg_id, reply_to, float(sent_at), weight_version, wants_reply, record)


def _bad(reason: str, err: Exception, fields: Any) -> BadMessage:
    bad = BadMessage(reason, f"{type(err).__name__}: {err}")
    if isinstance(fields, list) and len(fields) == 9:
        kind, sender, _, msg_id, _, _, _, wants_reply, _ = fields
        bad.kind = kind if isinstance(kind, str) else None
        bad.sender = sender if isinstance(sender, str) else None
        bad.id = msg_id if type(msg_id) is int else None
        bad.wants_reply = wants_reply is True
    return bad


def _view(library: Any, dtype: Any, shape: Any, buffer: Any, offset: int, nbytes: int) -> torch.Tensor | np.ndarray:
    """A tensor or array viewing ``buffer[offset:offset+nbytes]`` without a copy."""
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SchemaError(f"bad tensor shape {shape!r}")
    count = math.prod(shape)
    if library == "torch" and dtype in TORCH_DTYPE_NAMES:
        import torch  # the first tensor this process receives imports it

        torch_dtype = getattr(torch, dtype)
        if count * torch_dtype.itemsize != nbytes:
            raise SchemaError(f"tensor {dtype}{shape} needs {count * torch_dtype.itemsize} bytes, frame has {nbytes}")
        if count == 0:
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(buffer, dtype=torch_dtype, count=count, offset=offset).view(shape)
    if library == "numpy" and dtype in NUMPY_DTYPES:
        np_dtype = NUMPY_DTYPES[dtype]
        if count * np_dtype.itemsize != nbytes:
            raise SchemaError(f"array {dtype}{shape} needs {count * np_dtype.itemsize} bytes, frame has {nbytes}")
        return np.frombuffer(buffer, dtype=np_dtype, count=count, offset=offset).reshape(shape)
    raise SchemaError(f"unsupported tensor type {library!r}/{dtype!r}")
