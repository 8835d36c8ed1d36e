"""grail/tinker/wire.py against the SDK's own protobuf classes (the pinned `tinker`): what the SDK
writes, grail reads; what grail writes, the SDK reads. No server."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from grail.tinker import wire


def sdk_request(
    data: list[types.Datum], loss_fn: str, config: dict[str, float | str] | None = None
) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="session-1:train:0",
        seq_id=7,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    return message.SerializeToString()


def test_reads_what_the_sdk_writes() -> None:
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 0.5]},
        ),
        types.Datum(
            model_input=types.ModelInput(
                chunks=[types.EncodedTextChunk(tokens=[5]), types.EncodedTextChunk(tokens=[6])]
            ),
            loss_fn_inputs={
                "target_tokens": torch.tensor([6, 7]),
                "logprobs": np.array([-0.25, -1.5], dtype=np.float32),
                "advantages": np.array([-2.0, 3.0], dtype=np.float32),
            },
        ),
    ]
    req = wire.read_forward_backward(
        sdk_request(data, "ppo", {"clip_low_threshold": 0.75, "note": "text"})
    )
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == (
        "session-1:train:0", 7, "ppo", True,
    )  # fmt: skip
    assert req.loss_fn_config == {"clip_low_threshold": 0.75, "note": "text"}
    assert [d.tokens for d in req.data] == [[1, 2, 3], [5, 6]]
    assert req.data[0].inputs["target_tokens"].values.tolist() == [2, 3, 4]
    assert req.data[0].inputs["weights"].values.tolist() == [0.0, 1.0, 0.5]
    assert req.data[1].inputs["advantages"].values.tolist() == [-2.0, 3.0]
    assert req.data[1].inputs["logprobs"].values.dtype == np.float32


def test_reads_sparse_tensors_and_negative_ints() -> None:
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2, 3])
    tensor.sparse_csr.values = np.array([7, -9], dtype=np.int64).tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 1, 2], dtype=np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.array([2, 0], dtype=np.int64).tobytes()
    got = wire.read_tensor(tensor.SerializeToString())
    assert got.shape == [2, 3]
    assert got.values.reshape(2, 3).tolist() == [[0, 0, 7], [-9, 0, 0]]
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=-3, loss_fn="cross_entropy")
    assert wire.read_forward_backward(message.SerializeToString()).seq_id == -3


def test_our_message_types_match_the_sdk() -> None:
    """Each message grail declares has the SDK's field numbers, types and labels (its own subset
    of them), and each enum the SDK's values: the two agree on the wire by construction."""
    ours = wire._FILE
    for name, message in ours.message_types_by_name.items():
        sdk = pb.DESCRIPTOR.message_types_by_name[name]
        for f in message.fields:
            theirs = sdk.fields_by_name[f.name]
            kind, sdk_kind = (
                (f.number, f.type, f.is_repeated),
                (theirs.number, theirs.type, theirs.is_repeated),
            )
            assert kind == sdk_kind, f.full_name
            assert f.has_presence == theirs.has_presence, f.full_name
            if f.message_type is not None:
                assert f.message_type.name == theirs.message_type.name, f.full_name
                assert f.message_type.GetOptions().map_entry == (
                    theirs.message_type.GetOptions().map_entry
                )
            if f.containing_oneof is not None:
                assert f.containing_oneof.name == theirs.containing_oneof.name, f.full_name
    for name, enum in ours.enum_types_by_name.items():
        sdk_values = {v.name: v.number for v in pb.DESCRIPTOR.enum_types_by_name[name].values}
        assert {v.name: v.number for v in enum.values} == sdk_values


def test_refuses_what_it_cannot_read() -> None:
    body = sdk_request(
        [types.Datum(model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={})],
        "cross_entropy",
    )
    with pytest.raises(wire.WireError, match="truncated"):
        wire.read_forward_backward(body[:-1])
    image = pb.ForwardBackwardRequest(model_id="m")
    image.data.add().model_input.add().image.data = b"\x89PNG"
    with pytest.raises(wire.WireError, match="text tokens only"):
        wire.read_forward_backward(image.SerializeToString())
    # A chunk of a kind newer than grail's types (field 4 = 1): refused, not read as no tokens.
    with pytest.raises(wire.WireError, match="kind #4"):
        wire.read_forward_backward(b"\x1a\x04\x0a\x02\x20\x01")
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.read_forward_backward(b"\x1a\x05garbage")
    shapeless = pb.Tensor(dtype=pb.DTYPE_FLOAT32, dense=np.zeros(3, np.float32).tobytes())
    shapeless.shape.extend([2])
    with pytest.raises(wire.WireError, match="holds 3 values"):
        wire.read_tensor(shapeless.SerializeToString())


def test_the_sdk_reads_what_grail_writes() -> None:
    outputs = [
        {"logprobs": np.array([-1.0, -2.0, -3.0]), "elementwise_loss": np.array([0.0, 2.0, 3.0])},
        {"logprobs": np.array([-0.5]), "elementwise_loss": np.array([0.5])},
    ]
    result = deserialize_forward_backward_output(
        wire.write_forward_backward_output(outputs, {"loss:sum": 5.5})
    )
    assert result.metrics == {"loss:sum": 5.5}
    assert [o["logprobs"].tolist() for o in result.loss_fn_outputs] == [[-1.0, -2.0, -3.0], [-0.5]]
    assert result.loss_fn_outputs[0]["elementwise_loss"].shape == [3]

    sample = deserialize_sample_response(
        wire.write_sample_response(
            [wire.Sequence([1, 2], [-0.5, -0.25], stop=True), wire.Sequence([3], [-1.0], False)],
            [math.nan, -1.5, -2.5],
        )
    )
    assert [(s.stop_reason, s.tokens, s.logprobs) for s in sample.sequences] == [
        ("stop", [1, 2], [-0.5, -0.25]),
        ("length", [3], [-1.0]),
    ]
    assert sample.prompt_logprobs == [None, -1.5, -2.5]
