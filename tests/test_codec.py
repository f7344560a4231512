"""Codec: round trips (property-based), zero-copy views, and every bad-input case."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vime.scenarios.selfcheck import Blob, Note, Ping
from vime.transports.codec import (
    TORCH_DTYPE_NAMES,
    BadMessage,
    Envelope,
    FrameError,
    decode_frame,
    encode,
    encode_frame,
)
from vime.transports.records import SchemaError, build, message
from vime.transports.shm import SegmentPool, map_segment


@message
class Mixed:
    """test -> test: every supported field type at once."""

    count: int
    ratio: float
    name: str
    raw: bytes
    flag: bool
    maybe: int | None
    items: list[int]
    table: dict[str, float]
    anything: Any
    tensors: list[Any]


@message(kind_name=False)
class Part:
    """Nested inside Whole only."""

    label: str
    values: list[float]


@message
class Whole:
    """test -> test: a record holding records."""

    parts: list[Part]
    main: Part | None = None


@message
class Routed:
    """test -> test: a tensor that may be absent, as a Sample's routed experts."""

    experts: torch.Tensor | None


def envelope(payload: Any, msg_id: int = 1, wants_reply: bool = False) -> Envelope:
    return Envelope(type(payload).__name__, "a", "b", msg_id, None, 12.5, 3, wants_reply, payload)


def roundtrip(*envelopes: Envelope, resolve_shm: Any = None, **kwargs: Any) -> list[Envelope | BadMessage]:
    frame = encode_frame("ipc://peer-inbox", "tok", [encode(e, **kwargs) for e in envelopes])
    decoded = decode_frame(frame, max_message_bytes=1 << 30, resolve_shm=resolve_shm)
    assert decoded.reply_address == "ipc://peer-inbox"
    assert decoded.token == "tok"
    return decoded.messages


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype == torch.bool else t

    assert torch.equal(raw(a), raw(b))


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(sorted(TORCH_DTYPE_NAMES)), shape=shapes, transpose=st.booleans(),
       seed=st.integers(0, 2**31))
def test_torch_tensors_roundtrip_every_dtype_and_layout(dtype: str, shape: list[int], transpose: bool,
                                                         seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randint(-100, 100, shape, generator=generator).to(getattr(torch, dtype))
    if transpose and base.dim() >= 2:
        base = base.transpose(0, -1)  # non-contiguous input
    (decoded,) = roundtrip(envelope(Blob(tensor=base)))
    assert isinstance(decoded, Envelope)
    assert_same_tensor(decoded.payload.tensor, base)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "uint32"]), shape=shapes)
def test_numpy_arrays_roundtrip(dtype: str, shape: list[int]) -> None:
    array = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7).astype(dtype).reshape(shape)
    (decoded,) = roundtrip(envelope(Blob(tensor=array)))
    out = decoded.payload.tensor
    assert isinstance(out, np.ndarray) and out.dtype == array.dtype and out.shape == array.shape
    assert np.array_equal(out, array)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=80, deadline=None)
@given(
    count=st.integers(-(2**63), 2**63 - 1),
    ratio=st.floats(allow_nan=False),
    name=st.text(),
    raw=st.binary(),
    flag=st.booleans(),
    maybe=st.none() | st.integers(0, 10),
    items=st.lists(st.integers(-5, 5)),
    table=st.dictionaries(st.text(max_size=4), st.floats(allow_nan=False), max_size=4),
    anything=json_like,
    n_tensors=st.integers(0, 3),
)
def test_records_with_every_field_type_roundtrip(count, ratio, name, raw, flag, maybe, items, table, anything,
                                                 n_tensors):
    tensors = [torch.full((i + 1, 2), float(i), dtype=torch.bfloat16) for i in range(n_tensors)]
    payload = Mixed(count, ratio, name, raw, flag, maybe, items, table, anything, tensors)
    (decoded,) = roundtrip(envelope(payload))
    out = decoded.payload
    assert (out.count, out.ratio, out.name, out.raw, out.flag, out.maybe, out.items, out.table) == (
        count, ratio, name, raw, flag, maybe, items, table)
    assert out.anything == anything
    for a, b in zip(out.tensors, tensors, strict=True):
        assert_same_tensor(a, b)


def test_a_tensor_field_takes_a_tensor_or_none_and_refuses_an_array() -> None:
    """Read from its annotation without torch (vime.transports.records), or given as the class itself."""
    tensor = torch.arange(6, dtype=torch.int16).view(2, 3)
    (decoded,) = roundtrip(envelope(Routed(experts=tensor)))
    assert_same_tensor(decoded.payload.experts, tensor)
    assert roundtrip(envelope(Routed(experts=None)))[0].payload.experts is None
    evaluated = message(kind_name=False)(type("Evaluated", (), {"__annotations__": {"experts": torch.Tensor}}))
    assert build(evaluated, {"experts": tensor}).experts is tensor
    for record_type in (Routed, evaluated):
        with pytest.raises(SchemaError, match="expected Tensor, got ndarray"):
            build(record_type, {"experts": np.zeros(3)})


def test_batch_frame_keeps_order_and_envelope_fields() -> None:
    notes = [envelope(Note(seq=i, body=bytes([i]) * i), msg_id=i, wants_reply=i % 2 == 0) for i in range(50)]
    decoded = roundtrip(*notes)
    assert [m.payload.seq for m in decoded] == list(range(50))
    assert [m.wants_reply for m in decoded] == [i % 2 == 0 for i in range(50)]
    assert all(m.sent_at == 12.5 and m.weight_version == 3 and m.sender == "a" for m in decoded)


def test_nested_records_are_rebuilt_as_records() -> None:
    payload = Whole(parts=[Part("x", [1.0, 2.0]), Part("y", [])], main=Part("m", [0.5]))
    (decoded,) = roundtrip(envelope(payload))
    assert decoded.payload == payload
    assert isinstance(decoded.payload.parts[0], Part)


def test_received_tensors_view_the_frame_without_copy() -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    frame = encode_frame("x", None, [encode(envelope(Blob(tensor=tensor)))])
    (decoded,) = decode_frame(frame, max_message_bytes=1 << 30).messages
    view = decoded.payload.tensor
    frame_start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert frame_start <= view.data_ptr() < frame_start + len(frame)
    assert view.data_ptr() % 64 == frame_start % 64  # 64-byte aligned within the frame


def test_large_tensors_travel_through_shared_memory(tmp_path) -> None:
    pool = SegmentPool(tmp_path)
    tensor = torch.randn(300_000)
    (decoded,) = roundtrip(
        envelope(Blob(tensor=tensor)),
        shm_writer=lambda data: pool.lend(data, "b"),
        shm_threshold=1 << 20,
        resolve_shm=lambda name, nbytes: map_segment(name, nbytes, tmp_path),
    )
    assert torch.equal(decoded.payload.tensor, tensor)
    assert pool.lent == 1
    pool.close()
    assert list(tmp_path.iterdir()) == []
    assert torch.equal(decoded.payload.tensor, tensor)  # the mapping outlives the file


def test_segments_are_reused_only_once_given_back(tmp_path) -> None:
    pool = SegmentPool(tmp_path)
    first = pool.lend(memoryview(b"a" * (3 << 20)), "b")
    second = pool.lend(memoryview(b"b" * (3 << 20)), "b")
    assert first != second  # the first is still lent
    pool.give_back([first])
    assert pool.lend(memoryview(b"c" * (2 << 20)), "b") == first
    assert pool.lend(memoryview(b"d" * 10), "b") not in (first, second)  # too small to waste a big one on
    pool.reclaim("b")
    assert pool.lent == 0
    pool.close()


def test_idle_segments_beyond_the_cap_are_unlinked(tmp_path) -> None:
    pool = SegmentPool(tmp_path, max_idle_bytes=4 << 20)
    names = [pool.lend(memoryview(bytes(3 << 20)), "b") for _ in range(3)]
    pool.give_back(names)
    assert len(list(tmp_path.iterdir())) == 1
    pool.close()


def test_shared_memory_names_cannot_escape_the_segment_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a vime segment name"):
        map_segment("../../etc/passwd", 10, tmp_path)


@pytest.mark.parametrize("garbage", [b"", b"\x00", b"hello world, not a frame", bytes(range(256)) * 4])
def test_garbage_bytes_are_a_frame_error(garbage: bytes) -> None:
    with pytest.raises(FrameError):
        decode_frame(garbage, max_message_bytes=1 << 20)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes) -> None:
    try:
        frame = decode_frame(b"VIM1" + data, max_message_bytes=1 << 20)
    except FrameError:
        return
    assert all(isinstance(m, (Envelope, BadMessage)) for m in frame.messages)


def test_truncated_frame_keeps_the_intact_messages() -> None:
    frame = encode_frame("x", None, [encode(envelope(Note(seq=i, body=b"z" * 100), msg_id=i)) for i in range(3)])
    messages = decode_frame(bytes(frame[:-50]), max_message_bytes=1 << 20).messages
    assert [m.payload.seq for m in messages[:2]] == [0, 1]
    assert isinstance(messages[2], BadMessage) and messages[2].reason == "truncated"


def test_unknown_kind_is_reported_with_sender_and_id() -> None:
    header = msgpack.packb(["NoSuchKind", "mallory", "b", 7, None, 0.0, None, True, {}])
    frame = encode_frame("x", None, [_raw_encoded(header)])
    (bad,) = decode_frame(frame, max_message_bytes=1 << 20).messages
    assert isinstance(bad, BadMessage)
    assert (bad.reason, bad.kind, bad.sender, bad.id, bad.wants_reply) == ("schema", "NoSuchKind", "mallory", 7, True)
    assert "unknown message kind" in bad.error


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"payload": 5}, "expected bytes"),
        ({}, "missing field"),
        ({"payload": b"x", "extra": 1}, "unknown field"),
        ([1, 2], "expected a map"),
    ],
)
def test_schema_mismatch_is_a_bad_message(fields: Any, error: str) -> None:
    header = msgpack.packb(["Ping", "a", "b", 1, None, 0.0, None, True, fields])
    (bad,) = decode_frame(encode_frame("x", None, [_raw_encoded(header)]), max_message_bytes=1 << 20).messages
    assert bad.reason == "schema" and error in bad.error


def test_bool_is_not_accepted_as_int_and_int_widens_to_float() -> None:
    with pytest.raises(SchemaError):
        build(Note, {"seq": True, "body": b""})
    assert build(Mixed, dict(count=1, ratio=2, name="", raw=b"", flag=False, maybe=None, items=[], table={},
                             anything=None, tensors=[])).ratio == 2.0


def test_oversized_message_is_refused_but_identified() -> None:
    big = envelope(Ping(payload=b"x" * 5000), msg_id=9, wants_reply=True)
    small = envelope(Ping(payload=b"ok"), msg_id=10)
    bad, good = decode_frame(encode_frame("x", None, [encode(big), encode(small)]), max_message_bytes=1000).messages
    assert isinstance(bad, BadMessage) and bad.reason == "oversized" and bad.id == 9 and bad.wants_reply
    assert isinstance(good, Envelope) and good.payload.payload == b"ok"


def test_tensor_descriptor_pointing_outside_the_message_is_refused() -> None:
    ref = msgpack.ExtType(1, msgpack.packb(["torch", "float32", [1000], 0, 4000, None]))
    header = msgpack.packb(["Blob", "a", "b", 1, None, 0.0, None, False, {"tensor": ref}])
    (bad,) = decode_frame(encode_frame("x", None, [_raw_encoded(header)]), max_message_bytes=1 << 20).messages
    assert bad.reason == "schema" and "outside the message" in bad.error


def test_unknown_dtype_name_is_refused_not_looked_up() -> None:
    ref = msgpack.ExtType(1, msgpack.packb(["torch", "__class__", [0], 0, 0, None]))
    header = msgpack.packb(["Blob", "a", "b", 1, None, 0.0, None, False, {"tensor": ref}])
    (bad,) = decode_frame(encode_frame("x", None, [_raw_encoded(header)]), max_message_bytes=1 << 20).messages
    assert bad.reason == "schema" and "unsupported tensor type" in bad.error


def test_unserialisable_payload_fails_at_the_sender() -> None:
    with pytest.raises(TypeError, match="cannot travel"):
        encode(envelope(Blob(tensor=object())))


def _raw_encoded(header: bytes) -> Any:
    from vime.transports.codec import Encoded

    return Encoded(header, [], 0, [])


def test_frame_preamble_is_little_endian_magic_and_length() -> None:
    frame = encode_frame("x", None, [])
    magic, meta_len = struct.unpack_from("<4sI", frame)
    assert magic == b"VIM1" and meta_len == len(frame) - 8
