"""The protobuf bodies of the Tinker protocol, through the ``protobuf`` package: the SDK sends
``forward_backward`` as a protobuf ``ForwardBackwardRequest`` and accepts only protobuf for the
results of forward/backward (``ForwardBackwardOutput``) and of sampling (``SampleResponse``);
every other route is JSON.

The server imports nothing from the SDK, so the message types are our own: the subset of the
SDK's ``tinker_public.proto`` these bodies use, with its field numbers and types (docs/tinker.md
lists them), declared below as a ``FileDescriptorProto`` in a private descriptor pool (no protoc
at build time, and no clash with the SDK's own ``tinker_public`` types when a test loads both).
Fields we leave out (provenance spans, top-k logprobs, ...) are skipped on reading, as protobuf
skips any unknown field. Reading the 1024-datum body of an RL step takes ~13 ms, of which
protobuf's C parser (upb) ~0.4 ms and the rest this module's walk over 3072 tensors; the
hand-written varint codec this replaced took ~29 ms (benchmarks/tinker_wire.py, docs/tinker.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory
from google.protobuf.unknown_fields import UnknownFieldSet

# DType and StopReason enums of tinker_public.proto
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
STOP_REASON_STOP, STOP_REASON_LENGTH = 0, 1
_NUMPY_OF = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that is not the protobuf message it should be."""


# ---- the message types ---------------------------------------------------------------------

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "grail_tinker"
# name: [(field, number, type, oneof or None)]; a type is a scalar, enum or message name of this
# file, with "repeated " or (proto3 field presence) "optional " before it, or "map<string, T>".
_SCALARS = {"bytes": _F.TYPE_BYTES, "string": _F.TYPE_STRING, "int32": _F.TYPE_INT32,
            "int64": _F.TYPE_INT64, "bool": _F.TYPE_BOOL, "double": _F.TYPE_DOUBLE}  # fmt: skip
_ENUMS = {
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
}
_MESSAGES: dict[str, list[tuple[str, int, str, str | None]]] = {
    # ForwardBackwardRequest, what the SDK sends
    "EncodedTextChunk": [("tokens", 1, "bytes", None)],  # int32 little-endian
    "ImageChunk": [],  # contents unread: an image input is refused by its kind
    "DmelChunk": [],  # likewise audio
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "chunk"),
        ("image", 2, "ImageChunk", "chunk"),
        ("dmel", 3, "DmelChunk", "chunk"),
    ],
    "SparseCsr": [
        ("values", 1, "bytes", None),
        ("crow_indices", 2, "bytes", None),  # int64
        ("col_indices", 3, "bytes", None),  # int64
    ],
    "Tensor": [
        ("dense", 1, "bytes", "encoding"),
        ("sparse_csr", 2, "SparseCsr", "encoding"),
        ("dtype", 3, "DType", None),
        ("shape", 4, "repeated int64", None),
    ],
    "Datum": [
        ("model_input", 1, "repeated Chunk", None),
        ("loss_fn_inputs", 2, "map<string, Tensor>", None),
    ],
    "LossConfigValue": [("number", 1, "double", "value"), ("text", 2, "string", "value")],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", None),
        ("seq_id", 2, "int32", None),
        ("data", 3, "repeated Datum", None),
        ("loss_fn", 4, "string", None),
        ("loss_fn_config", 5, "map<string, double>", None),
        ("forward_only", 6, "bool", None),
        ("loss_fn_config_v2", 7, "map<string, LossConfigValue>", None),
    ],
    # ForwardBackwardOutput and SampleResponse, what the server answers
    "BatchedTensor": [
        ("data", 1, "bytes", None),
        ("offsets", 2, "bytes", None),  # int64 byte offsets of each datum's array in data
        ("dtype", 3, "DType", None),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", None),
        ("fields", 2, "map<string, BatchedTensor>", None),
        ("num_datums", 3, "int64", None),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", None),
        ("loss_fn_outputs", 2, "repeated ArrayRecord", None),
        ("metrics", 3, "map<string, double>", None),
    ],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", None),
        ("tokens", 2, "bytes", None),  # int32
        ("logprobs", 3, "optional bytes", None),  # float32
    ],
    "SampleResponse": [
        ("sequences", 1, "repeated SampledSequence", None),
        ("prompt_logprobs", 2, "optional bytes", None),  # float32, NaN where there is none
    ],
}


def _set_type(f: Any, kind: str) -> None:
    if kind in _SCALARS:
        f.type = _SCALARS[kind]
    elif kind in _ENUMS:
        f.type, f.type_name = _F.TYPE_ENUM, f".{_PACKAGE}.{kind}"
    elif kind in _MESSAGES:
        f.type, f.type_name = _F.TYPE_MESSAGE, f".{_PACKAGE}.{kind}"
    else:
        raise ValueError(f"unknown field type {kind!r}")


def _oneof_index(msg: Any, name: str) -> int:
    for i, decl in enumerate(msg.oneof_decl):
        if decl.name == name:
            return i
    msg.oneof_decl.add(name=name)
    return len(msg.oneof_decl) - 1


def _add_field(msg: Any, name: str, number: int, kind: str, oneof: str | None) -> None:
    f = msg.field.add(name=name, number=number, label=_F.LABEL_OPTIONAL)
    if kind.startswith("map<"):  # a repeated nested `XEntry {key = 1; value = 2}`, as protoc does
        key, value = kind[4:-1].split(", ")
        entry = msg.nested_type.add(name="".join(p.title() for p in name.split("_")) + "Entry")
        entry.options.map_entry = True
        _set_type(entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL), key)
        _set_type(entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL), value)
        f.label, f.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
        f.type_name = f".{_PACKAGE}.{msg.name}.{entry.name}"
        return
    if kind.startswith("repeated "):
        f.label, kind = _F.LABEL_REPEATED, kind.removeprefix("repeated ")
    elif kind.startswith("optional "):  # proto3 `optional`: presence, via a synthetic oneof
        f.proto3_optional, kind, oneof = True, kind.removeprefix("optional "), f"_{name}"
    _set_type(f, kind)
    if oneof is not None:
        f.oneof_index = _oneof_index(msg, oneof)


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(
        name="grail/tinker/wire.proto", package=_PACKAGE, syntax="proto3"
    )
    for name, values in _ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in _MESSAGES.items():
        msg = proto.message_type.add(name=name)
        # Real oneofs before the synthetic ones of `optional` fields, as protobuf requires.
        for real in dict.fromkeys(o for *_, o in fields if o is not None):
            _oneof_index(msg, real)
        for fname, number, kind, oneof in fields:
            _add_field(msg, fname, number, kind, oneof)
    return proto


_POOL = descriptor_pool.DescriptorPool()
_FILE = _POOL.Add(_file())
_CLASSES = {
    name: message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{_PACKAGE}.{name}"))
    for name in _MESSAGES
}
ForwardBackwardRequestProto = _CLASSES["ForwardBackwardRequest"]
ForwardBackwardOutputProto = _CLASSES["ForwardBackwardOutput"]
SampleResponseProto = _CLASSES["SampleResponse"]
TensorProto = _CLASSES["Tensor"]


def _parse(cls: Any, buf: bytes) -> Any:
    out = cls()
    try:
        out.ParseFromString(buf)
    except message.DecodeError as exc:
        name = cls.DESCRIPTOR.name
        raise WireError(f"not a {name} protobuf body (truncated or malformed): {exc}") from None
    return out


# ---- reading -------------------------------------------------------------------------------


@dataclass
class Tensor:
    """A ``TensorData``: values as a flat numpy array (dense, or densified from CSR), and its
    shape."""

    values: np.ndarray
    shape: list[int]


def read_tensor(buf: bytes) -> Tensor:
    return _tensor(_parse(TensorProto, buf))


def _tensor(t: Any) -> Tensor:
    np_dtype = _NUMPY_OF.get(t.dtype)
    if np_dtype is None:
        raise WireError(f"tensor dtype {t.dtype} is not float32, int64 or int32")
    shape = t.shape[:]  # a list; a slice is cheaper than list() on upb's container
    if t.WhichOneof("encoding") != "sparse_csr":
        values = np.frombuffer(t.dense, dtype=np_dtype)
        if not shape:
            shape = [values.size]
        if math.prod(shape) != values.size:
            raise WireError(f"tensor of shape {shape} holds {values.size} values")
        return Tensor(values, shape)
    # Sparse CSR (the SDK sends 2-D target_tokens / weights that way): rows of a [R, C] matrix.
    if len(shape) != 2:
        raise WireError(f"a sparse tensor needs a 2-D shape, got {shape}")
    csr = t.sparse_csr
    vals = np.frombuffer(csr.values, dtype=np_dtype)
    crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(csr.col_indices, dtype=np.int64)
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


def _tokens(chunks: Any) -> list[int]:
    if len(chunks) == 1 and chunks[0].WhichOneof("chunk") == "encoded_text":  # the common case
        return np.frombuffer(chunks[0].encoded_text.tokens, dtype="<i4").tolist()
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        elif kind is not None:
            kind = {"image": "image", "dmel": "audio (dmel)"}[kind]
            raise WireError(f"model_input chunk of kind {kind}: this server takes text tokens only")
        elif unknown := UnknownFieldSet(chunk):  # a kind newer than these types: not skipped
            raise WireError(
                f"model_input chunk of kind #{unknown[0].field_number}: "
                "this server takes text tokens only"
            )
    return tokens


def read_forward_backward(buf: bytes) -> ForwardBackwardRequest:
    msg = _parse(ForwardBackwardRequestProto, buf)
    data = []
    for d in msg.data:
        inputs = d.loss_fn_inputs  # by key: upb's map items() costs ~3x more per entry
        data.append(Datum(_tokens(d.model_input), {k: _tensor(inputs[k]) for k in inputs}))
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    # The SDK writes numbers to both maps and strings to v2 only; v2 wins, as on the hosted side.
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is not None:
            config[key] = getattr(value, kind)
    return ForwardBackwardRequest(
        msg.model_id, msg.seq_id, data, msg.loss_fn, config, msg.forward_only
    )


# ---- writing -------------------------------------------------------------------------------


def write_forward_backward_output(
    per_datum: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """``ForwardBackwardOutput`` of one ``ArrayRecord`` holding, per field, the datums' 1-D
    float32 arrays end to end (``BatchedTensor``: data, int64 byte offsets, dtype)."""
    out = ForwardBackwardOutputProto(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(per_datum))
    for name in sorted(per_datum[0]) if per_datum else []:
        arrays = [np.ascontiguousarray(d[name], dtype="<f4").reshape(-1) for d in per_datum]
        batched = record.fields[name]
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8").tobytes()
        batched.dtype = DTYPE_FLOAT32
    out.metrics.update(metrics)
    return bytes(out.SerializeToString(deterministic=True))  # deterministic: map keys sorted


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop: bool  # False: stopped at max_tokens ("length")


def write_sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """``SampleResponse``: each sequence's stop reason, int32 tokens and float32 logprobs, and
    the prompt's float32 logprobs (NaN where there is none: the first token)."""
    out = SampleResponseProto()
    for seq in sequences:
        out.sequences.add(
            stop_reason=STOP_REASON_STOP if seq.stop else STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return bytes(out.SerializeToString())
