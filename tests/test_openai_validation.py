"""OpenAI-style bodies checked on their own (fast tier): the chat validators name the field at
fault, and a Responses API request becomes the chat body /v1/chat/completions would take."""

import pytest

from kiln.supervisor.http_common import JSONError
from kiln.supervisor.openai_responses import chat_body
from kiln.supervisor.openai_validate import messages, sampling_params, tools


@pytest.mark.parametrize("check,body,param", [
    (messages, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    (messages, {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages[0].audio"),
    (sampling_params, {"top_p": 2}, "top_p"),
    (tools, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[0].function.parameters"),
    (tools, {"tool_choice": "required"}, "tool_choice"),
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
