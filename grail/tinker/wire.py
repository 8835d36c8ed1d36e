"""The protobuf bodies of the Tinker protocol, read and written by hand (no protobuf package, no
SDK import): the SDK sends ``forward_backward`` as a protobuf ``ForwardBackwardRequest`` and
accepts only protobuf for the results of forward/backward (``ForwardBackwardOutput``) and of
sampling (``SampleResponse``). Field numbers are those of the SDK's ``tinker_public.proto``
(docs/tinker.md lists them); every other route is JSON.

The wire format, as much of it as these messages use: a field is a varint key
``number << 3 | wire_type`` then its value, wire type 0 a varint (ints, bools, enums; a negative
int is its 64-bit two's complement), 1 eight little-endian bytes (double), 2 a varint length and
that many bytes (strings, bytes, messages, packed repeated ints), 5 four bytes (float). A map is a
repeated message of ``key = 1``, ``value = 2``. Unknown fields are skipped, as protobuf does.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

# DType enum of tinker_public.proto
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1
_NUMPY_OF = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that is not the protobuf message it should be."""


# ---- reading -------------------------------------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def _signed(value: int) -> int:
    """int32/int64 fields: the unsigned varint as a two's complement 64-bit number."""
    return value - (1 << 64) if value >= 1 << 63 else value


def fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(number, wire type, value) of each field of a message: varints as ints, fixed-width and
    length-delimited values as their bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos : pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos : pos + 4], pos + 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos : pos + length], pos + length
        else:
            raise WireError(f"unsupported wire type {wire} (field {number})")
        if pos > len(buf):
            raise WireError(f"truncated field {number}")
        yield number, wire, value


def _bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise WireError("expected a length-delimited field, got a varint")
    return value


def _int(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise WireError("expected a varint field")
    return _signed(value)


def _ints(wire: int, value: int | bytes) -> list[int]:
    """A repeated int field's entries in this occurrence: packed (one length-delimited run of
    varints, proto3's default) or one varint."""
    if wire == 0:
        return [_int(value)]
    buf, pos, out = _bytes(value), 0, []
    while pos < len(buf):
        v, pos = _varint(buf, pos)
        out.append(_signed(v))
    return out


def _double(value: int | bytes) -> float:
    return float(struct.unpack("<d", _bytes(value))[0])


def _map_entry(buf: bytes) -> tuple[str, int, int | bytes | None]:
    key, wire, value = "", 2, None
    for number, w, v in fields(buf):
        if number == 1:
            key = _bytes(v).decode()
        elif number == 2:
            wire, value = w, v
    return key, wire, value


@dataclass
class Tensor:
    """A ``TensorData``: values as a flat numpy array (dense, or densified from CSR), and its
    shape."""

    values: np.ndarray
    shape: list[int]


def read_tensor(buf: bytes) -> Tensor:
    dense: bytes | None = None
    csr: tuple[bytes, bytes, bytes] | None = None
    dtype, shape = 0, []
    for number, wire, value in fields(buf):
        if number == 1:
            dense = _bytes(value)
        elif number == 2:
            parts = {n: _bytes(v) for n, _, v in fields(_bytes(value))}
            csr = (parts.get(1, b""), parts.get(2, b""), parts.get(3, b""))
        elif number == 3:
            dtype = _int(value)
        elif number == 4:
            shape.extend(_ints(wire, value))
    np_dtype = _NUMPY_OF.get(dtype)
    if np_dtype is None:
        raise WireError(f"tensor dtype {dtype} is not float32, int64 or int32")
    if csr is None:
        values = np.frombuffer(dense or b"", dtype=np_dtype)
        if not shape:
            shape = [values.size]
        if math.prod(shape) != values.size:
            raise WireError(f"tensor of shape {shape} holds {values.size} values")
        return Tensor(values, shape)
    # Sparse CSR (the SDK sends 2-D target_tokens / weights that way): rows of a [R, C] matrix.
    if len(shape) != 2:
        raise WireError(f"a sparse tensor needs a 2-D shape, got {shape}")
    vals = np.frombuffer(csr[0], dtype=np_dtype)
    crow = np.frombuffer(csr[1], dtype=np.int64)
    col = np.frombuffer(csr[2], dtype=np.int64)
    if len(crow) != shape[0] + 1 or len(col) != len(vals) or (len(col) and col.max() >= shape[1]):
        raise WireError("inconsistent sparse CSR tensor")
    out = np.zeros(shape, dtype=np_dtype)
    rows = np.repeat(np.arange(shape[0]), np.diff(crow))
    out[rows, col] = vals
    return Tensor(out.reshape(-1), shape)


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool


def _read_chunks(buf: bytes) -> list[int]:
    tokens: list[int] = []
    for number, _, value in fields(buf):
        if number == 1:  # EncodedTextChunk { bytes tokens = 1 } (int32 little-endian)
            for n, _, v in fields(_bytes(value)):
                if n == 1:
                    tokens.extend(np.frombuffer(_bytes(v), dtype="<i4").tolist())
        else:
            kind = {2: "image", 3: "audio (dmel)"}.get(number, f"#{number}")
            raise WireError(f"model_input chunk of kind {kind}: this server takes text tokens only")
    return tokens


def read_forward_backward(buf: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest("", 0, [], "", {}, False)
    v1: dict[str, float] = {}
    v2: dict[str, float | str] = {}
    for number, _, value in fields(buf):
        if number == 1:
            req.model_id = _bytes(value).decode()
        elif number == 2:
            req.seq_id = _int(value)
        elif number == 3:
            datum = Datum([])
            for n, _, v in fields(_bytes(value)):
                if n == 1:
                    datum.tokens.extend(_read_chunks(_bytes(v)))
                elif n == 2:
                    key, _, tensor = _map_entry(_bytes(v))
                    datum.inputs[key] = read_tensor(_bytes(tensor or b""))
            req.data.append(datum)
        elif number == 4:
            req.loss_fn = _bytes(value).decode()
        elif number == 5:
            key, _, number_value = _map_entry(_bytes(value))
            v1[key] = _double(number_value) if number_value is not None else 0.0
        elif number == 6:
            req.forward_only = bool(_int(value))
        elif number == 7:  # LossConfigValue { double number = 1; string text = 2; }
            key, _, config_value = _map_entry(_bytes(value))
            for n, _, x in fields(_bytes(config_value or b"")):
                v2[key] = _double(x) if n == 1 else _bytes(x).decode()
    # The SDK writes numbers to both maps and strings to v2 only; v2 wins, as on the hosted side.
    req.loss_fn_config = {**v1, **v2}
    return req


# ---- writing -------------------------------------------------------------------------------


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def _varint_field(number: int, value: int) -> bytes:
    return _key(number, 0) + _encode_varint(value) if value else b""


def _double_field(number: int, value: float) -> bytes:
    return _key(number, 1) + struct.pack("<d", value)


def write_forward_backward_output(
    per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """``ForwardBackwardOutput`` of one ``ArrayRecord`` holding, per field, the datums' 1-D
    float32 arrays end to end (``BatchedTensor``: data, int64 byte offsets, dtype)."""
    names = sorted(per_datum[0]) if per_datum else []
    record = _len_field(1, b"ArrayRecord")
    for name in names:
        arrays = [np.ascontiguousarray(d[name], dtype="<f4").reshape(-1) for d in per_datum]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8")
        batched = (
            _len_field(1, b"".join(a.tobytes() for a in arrays))
            + _len_field(2, offsets.tobytes())
            + _varint_field(3, DTYPE_FLOAT32)
        )
        record += _len_field(2, _len_field(1, name.encode()) + _len_field(2, batched))
    record += _varint_field(3, len(per_datum))
    out = _len_field(1, b"ArrayRecord") + _len_field(2, record)
    for key in sorted(metrics):
        out += _len_field(3, _len_field(1, key.encode()) + _double_field(2, metrics[key]))
    return out


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool  # False: stopped at max_tokens ("length")


def write_sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """``SampleResponse``: each sequence's stop reason, int32 tokens and float32 logprobs, and
    the prompt's float32 logprobs (NaN where there is none: the first token)."""
    out = b""
    for seq in sequences:
        body = _varint_field(1, STOP_REASON_STOP if seq.stop else STOP_REASON_LENGTH)
        body += _len_field(2, np.asarray(seq.tokens, dtype="<i4").tobytes())
        body += _len_field(3, np.asarray(seq.logprobs, dtype="<f4").tobytes())
        out += _len_field(1, body)
    if prompt_logprobs is not None:
        out += _len_field(2, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    return out
