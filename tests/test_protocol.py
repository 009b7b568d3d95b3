"""The wire format: round trips, refusals, and fuzzing that only ever raises ProtocolError."""

import random

import pytest

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


def _signed(payload: list[bytes]) -> list[bytes]:
    from kiln.protocol.wire import _sign
    return [VERSION_FRAME, _sign(KEY, payload)] + payload


def random_frame_lists(n: int, seed: int = 0):
    """n frame lists, a fixed seed: random frames; the version frame then random ones; a valid
    message cut and spliced; and — signed with the right key, so the decoder gets past the
    signature — random or mutated msgpack headers and bodies."""
    import msgpack
    rng = random.Random(seed)
    blob = lambda k=64: rng.randbytes(rng.randint(0, k))            # noqa: E731
    values = [None, True, 1, -1, 2**70 % 2**64, 1.5, "x", "request", b"\x00", [], {}, [1, "a"], {"op": 3}]
    for i in range(n):
        family = i % 4
        if family == 0:
            yield [blob() for _ in range(rng.randint(0, 8))]
        elif family == 1:
            yield [VERSION_FRAME] + [blob() for _ in range(rng.randint(2, 6))]
        elif family == 2:
            fs = encode_frames(make(rng.choice(["heartbeat", "request"]), **({"op": "x"} if i % 8 == 2 else {})), KEY)
            j = rng.randrange(len(fs))
            yield fs[:j] + [fs[j][:rng.randint(0, len(fs[j]))] + blob(8)] + fs[j + 1:]
        else:
            header = {rng.choice(["type", "id", "ts", "op", "seq", "code", "deadline", "zz"]): rng.choice(values)
                      for _ in range(rng.randint(0, 5))}
            if rng.random() < 0.5:
                header.update(type=rng.choice(TYPES), id=rng.choice(["a", 1, None]))
            raw = [msgpack.packb(header, use_bin_type=True), msgpack.packb(rng.choice(values), use_bin_type=True)]
            k = rng.randrange(2)
            if rng.random() < 0.3 and raw[k]:                    # a byte flipped, then signed
                pos = rng.randrange(len(raw[k]))
                raw[k] = raw[k][:pos] + bytes([raw[k][pos] ^ (1 << rng.randrange(8))]) + raw[k][pos + 1:]
            yield _signed(raw + [blob(16) for _ in range(rng.randint(0, 2))])


def test_ten_thousand_random_frame_lists_raise_only_protocol_error():
    decoded = 0
    for frames in random_frame_lists(10_000):
        try:
            decode_frames(frames, KEY)
            decoded += 1
        except ProtocolError:
            pass
    # the signed family reaches the decoder: some of it is a valid message, most is refused there
    assert 0 < decoded < 2_500, decoded


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
