"""Modelfiles (native/models/created.py): what each instruction becomes, what is refused with
its line, the round trip back to text, and how a created model's defaults go under a request's
own fields."""

import pytest

from kiln.native.models.created import ModelfileError, applied, parse_modelfile, plain_name, to_modelfile
from kiln.protocol.sampling import out_of_bounds

TEXT = '''# a terse assistant
FROM hf.co/org/repo:Q4_K_M
PARAMETER temperature 0.2
PARAMETER stop "<|end|>"
PARAMETER stop "User:"
PARAMETER num_ctx 2048
ADAPTER zorb
SYSTEM """You are terse.
Answer in one line."""
MESSAGE user Hi
MESSAGE assistant Hello.
LICENSE MIT
'''


def test_every_instruction_and_the_round_trip():
    spec = parse_modelfile(TEXT, out_of_bounds)
    assert spec["from"] == "hf.co/org/repo:Q4_K_M" and spec["adapter"] == "zorb" and spec["license"] == "MIT"
    assert spec["system"] == "You are terse.\nAnswer in one line."
    assert spec["parameters"] == {"temperature": 0.2, "stop": ["<|end|>", "User:"], "min_ctx": 2048}
    assert spec["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert parse_modelfile(to_modelfile(spec), out_of_bounds) == spec


@pytest.mark.parametrize(("text", "says"), [
    ("PARAMETER temperature 0", "no FROM line"),
    ("FROM x\nTEMPLATE {{ .Prompt }}", "line 2: TEMPLATE"),
    ("FROM x\n\nPARAMETER mirostat 2", "line 3: PARAMETER 'mirostat' is not supported"),
    ("FROM x\nPARAMETER temperature hot", "needs a number"),
    ("FROM x\nPARAMETER temperature 7", "temperature = 7 is out of range"),
    ("FROM x\nPARAMETER num_ctx -5", "num_ctx must be a positive integer"),
    ("FROM x\nMESSAGE tool hi", "role 'tool'"),
    ("FROM x\nSYSTEM \"\"\"never closed", "line 2: the \"\"\" opened here is never closed"),
    ("FROM x\nFROBNICATE y", "line 2: FROBNICATE: unknown instruction"),
])
def test_what_cannot_be_done_as_written_is_refused_with_its_line(text, says):
    with pytest.raises(ModelfileError, match=says.replace("(", r"\(")):
        parse_modelfile(text, out_of_bounds)


def test_names_take_ollamas_latest_and_nothing_that_leaves_the_folder():
    assert plain_name("pirate:latest") == "pirate"
    for bad in ("../x", "a/b", "", "x" * 65, "pirate:v2"):
        with pytest.raises(ModelfileError):
            plain_name(bad)


def test_a_requests_own_fields_win_over_the_created_defaults():
    record = {"system": "S", "messages": [{"role": "user", "content": "m1"}], "adapter": "zorb",
              "parameters": {"temperature": 0, "max_tokens": 12, "min_ctx": 2048}}
    msgs, params, adapter = applied(record, [{"role": "user", "content": "q"}], {"temperature": 0.7}, None)
    assert msgs == [{"role": "system", "content": "S"}, {"role": "user", "content": "m1"}, {"role": "user", "content": "q"}]
    assert params == {"temperature": 0.7, "max_tokens": 12} and adapter == "zorb"
    msgs, _, adapter = applied(record, [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}], {}, "")
    assert msgs[0] == {"role": "system", "content": "mine"} and adapter == ""
    assert applied(record, None, {}, None)[0] is None                # a raw prompt has no messages to add to
