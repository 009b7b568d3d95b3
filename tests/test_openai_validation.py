"""Request bodies checked on their own (fast tier): the chat validators name the field at fault,
and a Responses API or an Anthropic Messages request becomes the chat body
/v1/chat/completions would take."""

import pytest

from kiln.supervisor.http.common import JSONError
from kiln.supervisor.http.openai_responses import chat_body
from kiln.supervisor.http.openai_validate import grammar, messages, sampling_params, tools


@pytest.mark.parametrize("check,body,param", [
    (messages, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    (messages, {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages[0].audio"),
    (sampling_params, {"top_p": 2}, "top_p"),
    (tools, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    (tools, {"tool_choice": "required"}, "tool_choice"),
    (grammar, {"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
    (grammar, {"grammar": ""}, "grammar"),
    (grammar, {"json_schema": "{}"}, "json_schema"),
    (grammar, {"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    (grammar, {"json_schema": {}, "tool_choice": "required"}, "json_schema"),
])
def test_a_bad_field_is_named(check, body, param):
    with pytest.raises(JSONError) as e:
        check(body)
    assert e.value.kiln_body["error"]["param"] == param


def test_responses_input_items_become_chat_messages():
    body = {"model": "m", "instructions": "be brief", "max_output_tokens": 7, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "call the tool"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "c2", "output": "noon"}],
        "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}}
    chat = chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},                 # the reasoning item is dropped
        {"role": "assistant", "content": "Checking.", "tool_calls": [     # both calls on that turn
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"}]
    assert messages(chat) == chat["messages"]                            # a valid chat conversation
    assert chat["max_tokens"] == 7 and chat["reasoning_effort"] == "low"
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                             "strict": None}}
    assert chat_body({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]


def test_anthropic_blocks_become_chat_messages():
    from kiln.supervisor.http import anthropic as anthropic_api
    body = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "be brief",
                                                       "cache_control": {"type": "ephemeral"}}],
            "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 100},
            "output_config": {"effort": "max"}, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "metadata": {"user_id": "u"}, "messages": [
                {"role": "user", "content": "call f"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                  {"type": "text", "text": "Calling."},
                                                  {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom",
                                              "is_error": True},
                                             {"type": "text", "text": "and now?"}]}]}
    chat = anthropic_api.chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [                  # thinking dropped
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"},             # the result, then the text
        {"role": "user", "content": "and now?"}]
    assert messages(chat) == chat["messages"]
    assert chat["max_tokens"] == 9 and chat["stop"] == ["END"]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    # thinking and effort are hints: applied where the template has the switch (workers/chat_plan.py)
    assert chat["template_hints"] == {"enable_thinking": True, "reasoning_effort": "high"}
    assert "template_hints" not in anthropic_api.chat_body({**body, "thinking": {"type": "adaptive"},
                                                            "output_config": {}})
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                                               "description": "d"}}]
    only_results = anthropic_api.chat_body({"max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text",
                                                                                            "text": "ok"}]}]}]})
    assert only_results["messages"] == [{"role": "tool", "tool_call_id": "x", "content": "ok"}]   # no empty user turn


def test_template_hints_apply_only_where_the_template_has_the_switch():
    from kiln.workers.chat_plan import PlanError, _template_vars
    thinking = "{% if enable_thinking %}<think>{% endif %}{{ messages }}"
    plain = "{{ messages }}"
    hints = {"template_hints": {"enable_thinking": False, "reasoning_effort": "high"}}
    assert _template_vars(hints, thinking) == {"enable_thinking": False}
    assert _template_vars(hints, plain) == {}                       # the model answers as it always does
    with pytest.raises(PlanError):                                  # asked outright, it is refused there
        _template_vars({"chat_template_kwargs": {"enable_thinking": False}}, plain)
    both = {"chat_template_kwargs": {"enable_thinking": True}, **hints}
    assert _template_vars(both, thinking) == {"enable_thinking": True}   # what was asked outright wins


def test_a_grammar_named_outright_goes_to_the_worker_as_is():
    assert grammar({"grammar": 'root ::= "a"'}) == {"grammar": {"gbnf": 'root ::= "a"'}}
    assert grammar({"json_schema": {"type": "integer"}, "response_format": {"type": "text"}}) == \
        {"grammar": {"json_schema": {"type": "integer"}}}
    assert grammar({}) == {}


def test_an_action_route_refuses_fields_it_would_ignore():
    import io
    from types import SimpleNamespace
    from kiln.supervisor.http.common import action_body
    req = lambda raw: SimpleNamespace(bounded_stream=io.BytesIO(raw), method="POST",  # noqa: E731
                                      path="/v1/models/smol/unload")
    assert action_body(req(b"")) == {} and action_body(req(b"{}")) == {}
    assert action_body(req(b'{"force": true}'), ("force",)) == {"force": True}
    with pytest.raises(JSONError) as e:
        action_body(req(b'{"force": true}'))
    assert e.value.kiln_body["error"]["param"] == "force" and "takes no fields" in e.value.kiln_body["error"]["message"]
    with pytest.raises(JSONError):
        action_body(req(b"[1]"))


def test_the_stop_string_limit_is_the_engines():
    from kiln.native.sampling import MAX_STOPS
    from kiln.supervisor.http import openai_validate
    assert openai_validate.MAX_STOPS == MAX_STOPS == 64
    assert sampling_params({"stop": [f"s{i}" for i in range(64)]})["stop"][-1] == "s63"
    with pytest.raises(JSONError):
        sampling_params({"stop": [f"s{i}" for i in range(65)]})
