"""The wire format: round trips, refusals, and fuzzing that only ever raises ProtocolError."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.protocol import (TYPES, VERSION_FRAME, ProtocolError, SchemaError, decode_frames, encode_frames,
                           make, validate_body, version_error)

KEY = b"k" * 32


def test_round_trip_with_raw_buffers():
    m = make("request", op="echo", body={"value": [1, "two", 3.0]}, buffers=[b"\x00" * 100, b"xyz"], deadline=5.0)
    d = decode_frames(encode_frames(m, KEY), KEY)
    assert (d.type, d.id, d.get("op"), d.body, d.buffers, d.get("deadline")) == \
        ("request", m.id, "echo", {"value": [1, "two", 3.0]}, [b"\x00" * 100, b"xyz"], 5.0)


def test_every_type_round_trips():
    extra = {"hello": dict(name="w", kind="k", pid=1, protocol=1, ops=["a"]), "request": dict(op="x"),
             "chunk": dict(seq=0), "error": dict(code="c", message="m")}
    for t in TYPES:
        assert decode_frames(encode_frames(make(t, **extra.get(t, {})), KEY), KEY).type == t


def test_another_version_is_named_in_the_error():
    frames = encode_frames(make("heartbeat"), KEY)
    with pytest.raises(ProtocolError) as e:
        decode_frames([b"KILN/9"] + frames[1:], KEY)
    assert e.value.kind == "version" and e.value.peer_version == "KILN/9"
    answer = decode_frames(version_error("KILN/9", KEY), KEY)
    assert "KILN/1" in answer.get("message") and "KILN/9" in answer.get("message")


def test_wrong_key_and_tampering_are_signature_errors():
    frames = encode_frames(make("request", op="x", body={"a": 1}), KEY)
    with pytest.raises(ProtocolError) as e:
        decode_frames(frames, b"other key")
    assert e.value.kind == "signature"
    frames[3] = frames[3][:-1] + b"\x02"
    with pytest.raises(ProtocolError, match="signature"):
        decode_frames(frames, KEY)


def test_frames_cannot_be_shifted_between_header_and_body():
    frames = encode_frames(make("reply", body=b"x"), KEY)
    merged = frames[:2] + [frames[2] + frames[3][:1], frames[3][1:]]
    with pytest.raises(ProtocolError):
        decode_frames(merged, KEY)


def test_missing_required_fields_are_named():
    from kiln.protocol.wire import Message
    bad = Message("request", "id1", {"type": "request", "id": "id1", "ts": 1.0})
    with pytest.raises(ProtocolError, match="'op'"):
        decode_frames(encode_frames(bad, KEY), KEY)


frame = st.binary(max_size=64)
frame_lists = st.one_of(
    st.lists(frame, max_size=8),
    st.lists(frame, min_size=2, max_size=6).map(lambda fs: [VERSION_FRAME] + fs),
    st.tuples(st.sampled_from(TYPES), st.integers(0, 3), st.binary(max_size=8)).map(
        lambda t: (lambda fs: fs[:2] + [fs[2][:t[1]] + t[2]] + fs[3:])(encode_frames(make("heartbeat"), KEY))),
)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame_lists)
def test_ten_thousand_random_frame_lists_raise_only_protocol_error(frames):
    try:
        decode_frames(frames, KEY)
    except ProtocolError:
        pass


def test_op_schemas_are_checked_at_the_boundary():
    assert validate_body("stream", {"n": 3}) == {"n": 3}
    with pytest.raises(SchemaError, match="'n' is required"):
        validate_body("stream", {})
    with pytest.raises(SchemaError, match="unknown field"):
        validate_body("stream", {"n": 1, "zz": 2})
    with pytest.raises(SchemaError, match="must be int"):
        validate_body("stream", {"n": True})


@pytest.mark.parametrize(("params", "field"), [({"temperature": 3.0}, "temperature"), ({"top_p": 1.5}, "top_p"),
                                               ({"max_tokens": -2}, "max_tokens"), ({"top_k": "4"}, "top_k"),
                                               ({"seed": True}, "seed")])
def test_a_worker_refuses_sampling_outside_the_shared_bounds(params, field):
    from kiln.protocol.ops import SchemaError, validate_body
    with pytest.raises(SchemaError, match=f"params.{field}"):
        validate_body("generate", {"text": "x", "params": params})
    validate_body("generate", {"text": "x", "params": {"temperature": 2, "max_tokens": -1, "top_k": 0}})


def test_the_http_edge_and_the_wire_share_the_sampling_bounds():
    """Every bound the HTTP edge checks is the wire's: a value just past it is refused at both."""
    from kiln.protocol.ops import SchemaError, validate_body
    from kiln.protocol.sampling import BOUNDS
    from kiln.supervisor.http.common import JSONError
    from kiln.supervisor.http.openai_validate import sampling_params
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repeat_penalty", "n", "typical_p"):
        kinds, low, high = BOUNDS[name]
        step = 1 if kinds == (int,) else 0.5
        for v in (low - step, high + step):
            with pytest.raises(JSONError):
                sampling_params({name: v})
            with pytest.raises(SchemaError):
                validate_body("generate", {"text": "x", "params": {name: v}})
