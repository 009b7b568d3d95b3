"""OpenAI's Responses API (stateless) through a real daemon with the official `openai` client:
the same answer as /v1/chat/completions for the same conversation, whole and streamed (the
events in order, their deltas making the final text), instructions as the system message, a
function call and its output sent back, a JSON schema, max_output_tokens as `incomplete`, and
every refused field named."""

import json
import os
import signal

import jsonschema
import openai
import pytest

from daemon_harness import Daemon, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
Q = "What is the capital of France?"
HI = "Say hi"                                   # answered within 200 tokens at temperature 0
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("responses"), {"default": {"kind": "inference",
                                                                    "model": str(default_model_path)}}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model loaded")
        yield d


@pytest.fixture
def client(served):
    served.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model ready")
    return openai.OpenAI(base_url=served.http + "/v1", api_key="unused", timeout=120)


def chat(client, messages, n=24):
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=n, temperature=0)
    return r.choices[0].message.content


def test_a_whole_answer_is_the_chat_answer_in_responses_shape(client):
    r = client.responses.create(model="default", input=Q, max_output_tokens=24, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text == chat(client, [{"role": "user", "content": Q}])
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.input_tokens > 5 and 1 <= r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # instructions are the system message; items may be messages with input_text parts
    r = client.responses.create(model="default", instructions="Answer in one word.", temperature=0,
                                max_output_tokens=16, input=[{"type": "message", "role": "user",
                                                              "content": [{"type": "input_text", "text": Q}]}])
    assert r.output_text == chat(client, [{"role": "system", "content": "Answer in one word."},
                                          {"role": "user", "content": Q}], 16)


def test_a_streamed_answer_sends_the_events_in_order_and_its_deltas_make_the_text(client):
    with client.responses.stream(model="default", input=HI, max_output_tokens=200, temperature=0) as st:
        events = list(st)
        final = st.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and deltas == final.output_text == chat(client, [{"role": "user", "content": HI}], 200)
    # cut by max_output_tokens: `incomplete`, whole and streamed
    r = client.responses.create(model="default", input=Q, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    last = list(client.responses.create(model="default", input=Q, max_output_tokens=3, temperature=0,
                                        stream=True))[-1]
    assert last.type == "response.incomplete" and last.response.output[0].content[0].text == r.output_text


def test_a_function_call_and_its_output_sent_back(client):
    r = client.responses.create(model="default", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", max_output_tokens=80, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    streamed = [e for e in client.responses.create(model="default", input="What is the weather in Paris?",
                                                   tools=[WEATHER], tool_choice="required", max_output_tokens=80,
                                                   temperature=0, stream=True)]
    done = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    c = calls[0]
    follow = client.responses.create(model="default", tools=[WEATHER], max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments},
        {"type": "function_call_output", "call_id": c.call_id, "output": "18 C and sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.usage.input_tokens > r.usage.input_tokens
    # the same conversation as chat messages gives the same answer
    assert follow.output_text == client.chat.completions.create(
        model="default", max_tokens=16, temperature=0, tools=[{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": c.call_id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}}]},
            {"role": "tool", "tool_call_id": c.call_id, "content": "18 C and sunny"}]).choices[0].message.content


def test_a_json_schema_format_constrains_the_text(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(model="default", input="Name a city as JSON.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_included_logprobs_are_the_chat_routes_whole_and_streamed(client, served):
    """A field added after the redesign (issue 36): include + top_logprobs, as the chat route's
    logprobs: the same tokens, log-probabilities and alternatives."""
    ref = client.chat.completions.create(model="default", messages=[{"role": "user", "content": Q}], max_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    ref = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in ref]

    def said(lps):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in lps]
    ask = dict(model="default", input=Q, max_output_tokens=8, temperature=0, top_logprobs=3,
               include=["message.output_text.logprobs"])
    r = client.responses.create(**ask)
    assert said(r.output[0].content[0].logprobs) == ref and len(ref) == r.usage.output_tokens
    events = list(client.responses.create(**ask, stream=True))
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert said(deltas) == said(done.logprobs) == ref
    # without include, none; top_logprobs alone asks for nothing it could give
    assert client.responses.create(model="default", input=Q, max_output_tokens=2).output[0].content[0].logprobs == []
    status, err = http_json(served, "POST", "/v1/responses", {"model": "default", "input": Q, "top_logprobs": 2})
    assert status == 400 and err["error"]["param"] == "top_logprobs", err


@pytest.mark.parametrize("body,param,words", [
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs", "0 to 20"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
    ({"input": "hi", "conversation": "c"}, "conversation", "whole conversation"),
    ({"input": "hi", "store": True}, "store", "keeps no responses"),
    ({"input": "hi", "truncation": "middle"}, "truncation", "truncation must be \"auto\""),
    ({"input": "hi", "frob": 1}, "frob", "unsupported field"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "system", "content": "x"}]}, "input", "no message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "must be a data: URI"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type", "not supported"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]", "function tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", "function name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}},
     "text.format.schema", "not a valid JSON schema"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning.effort", "reasoning.effort must be"),
    ({"input": "hi", "max_output_tokens": 10 ** 8}, "input", "max_output_tokens"),
])
def test_refused_fields_are_named(served, body, param, words):
    status, err = http_json(served, "POST", "/v1/responses", {"model": "default", **body})
    assert status == 400, err
    assert err["error"]["param"] == param and words in err["error"]["message"], err


def test_a_worker_killed_mid_stream_ends_it_with_response_failed(client, served):
    pid = served.worker("default")["pid"]
    events = []
    for e in client.responses.create(model="default", input="Write a long story.", max_output_tokens=400,
                                     temperature=0, stream=True):
        events.append(e)
        if len(events) == 8:
            os.kill(pid, signal.SIGKILL)
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed", [e.type for e in events[-3:]]
    assert last.response.error.code and last.response.error.message
    assert not any(e.type == "response.completed" for e in events)
