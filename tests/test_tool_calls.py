"""Tool calls and reasoning without a daemon: every native call format parsed from model output
(whole, and split at every character boundary), the reasoning split, tools presented to a
template, and each format's grammar driving the default model to a call that parses back and
validates against the function's schema."""

import json

import jsonschema
import numpy as np
import pytest

from kiln.native.chat_output import ChatOutput, ReasoningSplitter
from kiln.native.chat_template import ChatTemplate
from kiln.native.constrain import Constraint, GrammarError, check, json_schema_grammar, lark_grammar
from kiln.native.generate import Generation
from kiln.native.sampling import SamplingParams
from kiln.native.tool_calls import ToolCallParser, call_grammar, detect_format, prepare

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]

# model outputs in each family's native form (as the vendors' templates and docs write them)
CAPTURED = {
    "hermes": ('I will look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
               "I will look that up.\n", [("get_weather", {"city": "Paris", "days": 2}),
                                          ("get_time", {"zone": "Europe/Paris"})]),
    "qwen_xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
                 "</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "New York", "days": 3})]),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', "",
               [("get_weather", {"city": "Oslo", "days": 1})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 5}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "",
                [("get_weather", {"city": "Rome", "days": 5}), ("get_time", {"zone": "UTC"})]),
}


def _run(fmt, pieces):
    p = ToolCallParser(fmt, TOOLS)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    text = "".join(v for k, v in events if k == "text")
    return text, [(v.name, json.loads(v.arguments)) for k, v in events if k == "call"]


@pytest.mark.parametrize("fmt", sorted(CAPTURED))
def test_every_native_format_parses_split_anywhere(fmt):
    out, text, calls = CAPTURED[fmt]
    assert _run(fmt, [out]) == (text, calls)
    assert _run(fmt, list(out)) == (text, calls)
    for i in range(len(out) + 1):
        assert _run(fmt, [out[:i], out[i:]]) == (text, calls), i


def test_qwen_xml_values_may_hold_their_own_closing_tags_mid_text():
    code = 'if "</parameter>" in s:\n    s = s.split("</function>")[0]'
    out = (f"<tool_call>\n<function=get_time>\n<parameter=zone>\n{code}\n</parameter>\n</function>\n</tool_call>"
           "<tool_call>\n<function=get_weather>\n<parameter=city>Oslo</parameter><parameter=days>2</parameter>\n"
           "</function>\n</tool_call>")
    assert _run("qwen_xml", list(out)) == ("", [("get_time", {"zone": code}), ("get_weather", {"city": "Oslo", "days": 2})])


@pytest.mark.parametrize("fmt", ["hermes", "qwen_xml"])
def test_a_value_may_hold_the_call_end_marker_itself(fmt):
    """Code about tool calls: `</tool_call>` inside a value does not end the call — only a marker
    after which the call parses does — and a malformed call before a good one stays text while
    the good one is still a call, split anywhere."""
    code = 'out = "<tool_call>" + body + "</tool_call>"'
    if fmt == "hermes":
        call = "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {"zone": code}}) + "\n</tool_call>"
    else:
        call = f"<tool_call>\n<function=get_time>\n<parameter=zone>\n{code}\n</parameter>\n</function>\n</tool_call>"
    for i in range(len(call) + 1):
        assert _run(fmt, [call[:i], call[i:]]) == ("", [("get_time", {"zone": code})]), i
    bad = "<tool_call>not a call</tool_call> then "
    assert _run(fmt, list(bad + call)) == ("<tool_call>not a call</tool_call> then ", [("get_time", {"zone": code})])


def test_mistral_v11_form_and_llama3_python_tag():
    assert _run("mistral", ['[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}']) == ("", [("get_time", {"zone": "UTC"})])
    assert _run("llama3", ['<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}']) == \
        ("", [("get_time", {"zone": "UTC"})])


def test_text_that_only_looks_like_a_call_stays_text():
    for fmt, out in [("hermes", "use <tool_call> tags like <tool_call>not json</tool_call> ok"),
                     ("hermes", "a < b and <tool_ca"), ("llama3", "Sure: {not a call}"),
                     ("llama3", '{"no_name": 1}')]:
        text, calls = _run(fmt, list(out))
        assert (text, calls) == (out, []), fmt


def test_reasoning_splits_anywhere_and_feeds_the_call_parser():
    out = "<think>\nThe user wants weather.\n</think>\n\nChecking.<tool_call>\n" \
          '{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for i in range(len(out) + 1):
        o = ChatOutput("hermes", TOOLS, thinking=False)
        parts = [o.feed(out[:i]), o.feed(out[i:]), o.finish()]
        assert "".join(p.get("reasoning", "") for p in parts) == "The user wants weather.\n", i
        assert "".join(p.get("text", "") for p in parts) == "Checking.", i
        assert [c.name for p in parts for c in p.get("tool_calls", [])] == ["get_time"], i
    # a prompt that already opened the block (Qwen3.5): the answer starts inside it
    s = ReasoningSplitter(thinking=True)
    assert s.feed("plan</think>\n\nanswer") + s.finish() == [("reasoning", "plan"), ("text", "answer")]


def test_detect_format_reads_the_template():
    assert detect_format("{{ messages }}") == "generic"
    assert detect_format("{% if tools %}<tool_call>{{ tools }}{% endif %}") == "hermes"
    assert detect_format("{% if tools %}<tool_call><function={{ name }}>{% endif %}") == "qwen_xml"
    assert detect_format("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert detect_format('{% if tools %}{{ render_tool_namespace("functions", tools) }}{% endif %}'
                         "<|start|>assistant<|channel|>commentary to=functions.x") == "harmony"


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HERMES = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
          "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_without_tools_gets_them_in_a_system_message_and_results_as_text():
    conv = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    msgs, extra = prepare(conv, TOOLS, "generic")
    assert extra == {}
    text = ChatTemplate(CHATML).render(msgs)
    assert '"name": "get_weather"' in text and "<tools>" in text and text.index("<tools>") < text.index("weather?")
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>" in text


def test_a_template_with_tools_receives_them_and_calls_with_object_arguments():
    conv = [{"role": "user", "content": "t?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}]
    msgs, extra = prepare(conv, TOOLS, "hermes")
    text = ChatTemplate(HERMES).render(msgs, **extra)
    assert '"get_weather"' in text
    assert '{"name": "get_time", "arguments": {"zone": "UTC"}}' in text


# gpt-oss's form (written for this test after its template's shape): tools as a namespace in the
# developer message, calls as commentary messages to functions.NAME, results from functions.NAME
HARMONY_TEMPLATE = ("{% if tools %}<|start|>developer<|message|>namespace functions {\n{% for t in tools %}type "
           "{{ t.function.name }} = (_: any) => any;\n{% endfor %}}<|end|>{% endif %}{% for m in messages %}"
           "{% if m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant<|channel|>commentary to=functions."
           "{{ c.function.name }} <|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
           "{% elif m.role == 'tool' %}<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"
           "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
           "{% endfor %}<|start|>assistant")


def test_a_harmony_template_lists_the_tools_itself_and_keeps_calls_and_results_in_its_form():
    assert detect_format(HARMONY_TEMPLATE) == "harmony"
    conv = [{"role": "user", "content": "t?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"}]
    msgs, extra = prepare(conv, TOOLS, "harmony")
    text = ChatTemplate(HARMONY_TEMPLATE).render(msgs, **extra)
    assert "type get_weather = " in text and "<tool_call>" not in text and "<tools>" not in text
    assert 'to=functions.get_time <|constrain|>json<|message|>{"zone": "UTC"}<|call|>' in text
    assert "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>12:00<|end|>" in text


@pytest.fixture(scope="module")
def model(default_model_path):
    from kiln.native.model import load_model
    return load_model(default_model_path)


def _generate(model, grammar, temperature, seed, prompt="What is the weather in Paris for 2 days?"):
    tok = model.tokenizer
    ids = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=temperature, seed=seed, max_tokens=250, grammar=grammar)
    gen = Generation(model, ids, params, show=frozenset(i for i in map(tok.id_of, ["[TOOL_CALLS]"]) if i is not None))
    cache = model.new_cache(512)
    logits = model.forward(ids, cache)
    text = ""
    while True:
        t = gen.step(logits)
        text += t.text
        if gen.done:
            break
        logits = model.forward([t.id], cache)
    return text + gen.finish().text, gen.reason


@pytest.mark.parametrize("fmt", ["generic", "hermes", "qwen_xml", "llama3", "mistral"])
@pytest.mark.parametrize("temperature, seed", [(0, None), (1.0, 3)])
def test_each_formats_grammar_gives_a_call_that_parses_and_validates(model, fmt, temperature, seed):
    grammar = lark_grammar(call_grammar(fmt, TOOLS, False, {}))
    check(grammar, model.tokenizer)
    text, reason = _generate(model, grammar, temperature, seed)
    assert reason == "stop", text
    got, calls = _run(fmt, [text])
    assert got.strip() == "" and len(calls) == 1, text
    name, args = calls[0]
    jsonschema.validate(args, {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"])


def test_qwen_xml_string_values_span_lines_end_at_their_tag_and_keep_their_bounds(model):
    """A Qwen XML string parameter may hold several lines and "<" (code, HTML) and ends at the
    first "\n</parameter>\n"; minLength, maxLength and pattern hold (the JSON formats get them
    from the schema grammar)."""
    import llguidance
    from kiln.native.constrain import _lltokenizer
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["code"],
        "properties": {"code": {"type": "string"},
                       "tag": {"type": "string", "minLength": 2, "maxLength": 5, "pattern": "^[a-z]+$"}}}}}]
    grammar = lark_grammar(call_grammar("qwen_xml", tools, False, {}))
    lt = _lltokenizer(model.tokenizer)

    def accepts(text):
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        return all(m.consume_token(t) for t in model.tokenizer.encode(text, add_bos=False)) and m.is_accepting()
    code = "<tool_call>\n<function=f>\n<parameter=code>\nif a < b:\n    return '</p>'\n</parameter>\n"
    end = "</function>\n</tool_call>"
    assert accepts(code + end)
    assert accepts(code + "<parameter=tag>\nabc\n</parameter>\n" + end)
    for bad in ("abcdef", "a", "ab1"):                    # too long, too short, off the pattern
        assert not accepts(code + f"<parameter=tag>\n{bad}\n</parameter>\n" + end), bad
    assert not accepts(code.replace("</parameter>\n", "</parameter>\nmore\n</parameter>\n") + end)


def test_json_schema_grammar_holds_and_bad_schemas_are_errors(model):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    text, reason = _generate(model, json_schema_grammar(schema), 1.0, 11, "Pick a number.")
    jsonschema.validate(json.loads(text), schema)
    assert reason == "stop"
    with pytest.raises(GrammarError):
        check(json_schema_grammar({"type": "wat"}), model.tokenizer)
    with pytest.raises(GrammarError):
        Constraint(lark_grammar("start: ("), model.tokenizer)


def test_the_mask_only_lets_the_grammar_through(model):
    c = Constraint(lark_grammar('start: "yes" | "no"'), model.tokenizer)
    masked = c.apply(np.zeros(model.tokenizer.vocab_size, np.float32))
    allowed = np.flatnonzero(np.isfinite(masked))
    assert 0 < len(allowed) < 20
    assert all(model.tokenizer.decode([int(i)]) in ("y", "ye", "yes", "n", "no") for i in allowed)


HARMONY = ("<|channel|>analysis<|message|>The user asks for the weather; call the tool.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.")


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_harmony_messages_split_into_reasoning_and_answer_however_the_text_arrives(step):
    out = ChatOutput(None, None, None, harmony=True)
    got = {"text": "", "reasoning": "", "tool_calls": []}
    for i in range(0, len(HARMONY), step):
        for k, v in out.feed(HARMONY[i:i + step]).items():
            got[k] += v
    for k, v in out.finish().items():
        got[k] += v
    assert got == {"text": "It is sunny in Paris.", "reasoning": "The user asks for the weather; call the tool.",
                   "tool_calls": []}


def test_a_harmony_message_to_a_function_is_a_tool_call_and_a_headerless_answer_is_text():
    out = ChatOutput(None, None, None, harmony=True)
    text = ("<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}')
    first, last = out.feed(text), out.finish()           # <|call|> ended generation: not in the text
    assert first == {"reasoning": "Need the tool."}
    (call,) = last["tool_calls"]
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "get_weather", {"city": "Paris", "days": 2})
    assert out.calls == [call]
    plain = ChatOutput(None, None, None, harmony=True)   # a constrained answer starts with no header
    assert plain.feed('{"a": 1}') == {"text": '{"a": 1}'} and plain.finish() == {}


def test_a_harmony_vocabulary_ends_at_return_or_call_not_at_each_messages_end(tiny_gpt_oss_harmony):
    tok = tiny_gpt_oss_harmony
    assert tok.harmony
    ids = {n: tok.id_of(n) for n in ("<|end|>", "<|return|>", "<|call|>")}
    assert ids["<|end|>"] not in tok.special.stop_ids
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.special.stop_ids


@pytest.fixture(scope="module")
def tiny_gpt_oss_harmony():
    """The tiny gpt-oss file's tokenizer with seven of its tokens renamed to harmony's markers
    (the tiny reference has a small ChatML vocabulary; a real gpt-oss file is 13 GB)."""
    from pathlib import Path
    from types import SimpleNamespace
    from kiln.native.gguf_file import read_gguf
    from kiln.native.tokenizer import GGUFTokenizer
    g = read_gguf(Path(__file__).parent / "data" / "tiny" / "tiny-gpt-oss.gguf")
    meta = dict(g.metadata)
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    for k, name in enumerate(("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
                              "<|constrain|>")):
        i = len(tokens) - 1 - k
        tokens[i], types[i] = name, 3                   # control, as gpt-oss files mark them
    meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"] = tokens, types
    return GGUFTokenizer(SimpleNamespace(metadata=meta, path=g.path))
