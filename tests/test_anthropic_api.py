"""Anthropic's Messages API through a real daemon with the official `anthropic` client (as Claude
Code talks to it): the same answer as /v1/chat/completions for the same conversation, whole and
streamed, a tool_use and its tool_result sent back, stop sequences named, count_tokens equal to
what the answer's usage counts, an API key sent as x-api-key, and errors in Anthropic's shape."""

import json
import os
import signal

import anthropic
import jsonschema
import openai
import pytest

from daemon_harness import Daemon, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
Q = "What is the capital of France?"
HI = "Say hi"                                   # answered within 200 tokens at temperature 0
T0 = {"extra_body": {"temperature": 0}}        # the 2026 SDK has no temperature argument; the API does
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    with Daemon(tmp_path_factory.mktemp("anthropic"), {"default": {"kind": "inference",
                                                                    "model": str(default_model_path)}}) as d:
        yield d


@pytest.fixture
def client(served):
    served.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model ready")
    return anthropic.Anthropic(base_url=served.http, api_key="unused", timeout=120, max_retries=0)


def chat(served, messages, n, **kw):
    oa = openai.OpenAI(base_url=served.http + "/v1", api_key="unused", timeout=120)
    return oa.chat.completions.create(model="default", messages=messages, max_tokens=n, temperature=0, **kw)


def test_a_whole_and_a_streamed_answer_are_the_chat_answers(client, served):
    m = client.messages.create(model="default", max_tokens=24, messages=[{"role": "user", "content": Q}], **T0)
    c = chat(served, [{"role": "user", "content": Q}], 24)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if c.choices[0].finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens
    assert m.usage.output_tokens == c.usage.completion_tokens
    with client.messages.stream(model="default", max_tokens=200, system="Be kind.",
                                messages=[{"role": "user", "content": HI}], **T0) as st:
        events = list(st)
        final = st.get_final_message()
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    want = chat(served, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": HI}], 200)
    assert text == final.content[0].text == want.choices[0].message.content and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == want.usage.completion_tokens
    # message_start says the prompt's tokens, as Anthropic's API does (issue 42: it said 0)
    start = next(e for e in events if e.type == "message_start").message.usage
    assert start.input_tokens + (start.cache_read_input_tokens or 0) == want.usage.prompt_tokens > 5, start
    assert start.output_tokens == 0


def test_a_tool_use_and_its_result_sent_back(client, served):
    m = client.messages.create(model="default", max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather in Paris?"}], **T0)
    assert m.stop_reason == "tool_use"
    [tu] = [b for b in m.content if b.type == "tool_use"]
    assert tu.name == "get_weather" and tu.id
    jsonschema.validate(tu.input, WEATHER["input_schema"])
    with client.messages.stream(model="default", max_tokens=80, tools=[WEATHER], tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}], **T0) as st:
        streamed = st.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(tu.name, tu.input)]
    follow = client.messages.create(model="default", max_tokens=16, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": tu.id, "name": tu.name, "input": tu.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "18 C and sunny",
                                      "cache_control": {"type": "ephemeral"}}]}], **T0)
    want = chat(served, [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [{"id": tu.id, "type": "function",
                          "function": {"name": tu.name, "arguments": json.dumps(tu.input)}}]},
                         {"role": "tool", "tool_call_id": tu.id, "content": "18 C and sunny"}], 16,
                tools=[{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                         "parameters": WEATHER["input_schema"]}}])
    assert follow.content[0].text == want.choices[0].message.content
    # count_tokens is the prompt the answer ran: its usage counts the same
    counted = client.messages.count_tokens(model="default", tools=[WEATHER],
                                           messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_max_tokens_is_an_upper_bound_as_claude_code_uses_it(client):
    """Claude Code asks for 32000 tokens whatever the model: the answer runs to its end (or the
    context's), not refused for a context of 8192."""
    m = client.messages.create(model="default", max_tokens=32000, messages=[{"role": "user", "content": HI}], **T0)
    assert m.stop_reason == "end_turn" and m.content[0].text


def test_stop_sequences_and_structured_output(client):
    m = client.messages.create(model="default", max_tokens=50, stop_sequences=["Paris"], **T0,
                               messages=[{"role": "user", "content": "The capital of France is which city?"}])
    if m.stop_reason == "stop_sequence":                 # whether the model says it is the model's business
        assert m.stop_sequence == "Paris" and "Paris" not in m.content[0].text
    else:
        assert "Paris" not in m.content[0].text
    forced = client.messages.create(model="default", max_tokens=50, stop_sequences=[" "], **T0,
                                    messages=[{"role": "user", "content": Q}])
    assert forced.stop_reason == "stop_sequence" and forced.stop_sequence == " "
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
              "additionalProperties": False}
    r = client.messages.create(model="default", max_tokens=60, output_config={"format": {"type": "json_schema",
                                                                                          "schema": schema}},
                               messages=[{"role": "user", "content": "Name a city as JSON."}])
    jsonschema.validate(json.loads(r.content[0].text), schema)


@pytest.mark.parametrize("body,words", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens is required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "an image source is"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "container": "c"}, "code execution"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "speed": "fast"}, "standard"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "frob": 1}, "unsupported field"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "output_config": {"effort": "extreme"}}, "effort must be"),
    ({"max_tokens": 5, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"max_tokens": 32000, "messages": [{"role": "user", "content": "hi " * 9000}]}, "context holds"),
])
def test_errors_are_in_anthropics_shape(served, body, words):
    status, err = http_json(served, "POST", "/v1/messages", {"model": "default", **body})
    assert status == 400 and err["type"] == "error", err
    assert err["error"]["type"] == "invalid_request_error" and words in err["error"]["message"], err


def test_a_worker_killed_mid_stream_ends_it_with_an_error_event(client, served):
    pid = served.worker("default")["pid"]
    seen = []
    with pytest.raises(anthropic.APIStatusError) as e:
        with client.messages.stream(model="default", max_tokens=400, **T0,
                                    messages=[{"role": "user", "content": "Write a long story."}]) as st:
            for ev in st:
                seen.append(ev.type)
                if len(seen) == 6:
                    os.kill(pid, signal.SIGKILL)
    assert "message_stop" not in seen and e.value.message


def test_an_api_key_is_taken_as_x_api_key(default_model_path, tmp_path):
    with Daemon(tmp_path, {"default": {"kind": "inference", "model": str(default_model_path)}},
                server={"api_key": "sekrit"}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model ready")
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=d.http, api_key="wrong", max_retries=0).messages.create(
                model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        ok = anthropic.Anthropic(base_url=d.http, api_key="sekrit", max_retries=0).messages.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert ok.usage.output_tokens >= 1


def _streamed_text(path: str, lines: list[str]) -> str:
    out = []
    for ln in lines:
        if not ln.startswith("data: {"):
            continue
        ev = json.loads(ln[6:])
        if path == "/v1/messages" and ev.get("type") == "content_block_delta":
            out.append(ev["delta"].get("text", ""))
        elif path == "/v1/responses" and ev.get("type") == "response.output_text.delta":
            out.append(ev["delta"])
        elif path == "/v1/chat/completions" and ev.get("choices"):
            out.append(ev["choices"][0]["delta"].get("content") or "")
    return "".join(out)


def test_a_long_prefill_keeps_each_stream_alive(default_model_path, tmp_path):
    """A prompt whose prefill takes seconds: each stream starts at once and sends keep-alives
    (an SSE comment; Anthropic's ping) before its first token — and the answer is the same."""
    import http.client
    import time
    long = " ".join(f"item{i}" for i in range(80))           # ~320 tokens: a second and more of prefill here
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "A: " + long}], "max_tokens": 4},
              "/v1/messages": {"messages": [{"role": "user", "content": "B: " + long}], "max_tokens": 4},
              "/v1/responses": {"input": "C: " + long, "max_output_tokens": 4}}   # no shared prefix: no cache
    whole_text = {"/v1/chat/completions": lambda w: w["choices"][0]["message"]["content"],
                  "/v1/messages": lambda w: w["content"][0]["text"],
                  "/v1/responses": lambda w: w["output"][0]["content"][0]["text"]}
    with Daemon(tmp_path, {"default": {"kind": "inference", "model": str(default_model_path)}},
                server={"stream_keepalive": 0.2}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model ready")
        host, port = d.http.removeprefix("http://").split(":")
        for path, body in bodies.items():
            body = {"model": "default", "stream": True, "temperature": 0, **body}
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            t0 = time.monotonic()
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            started = time.monotonic() - t0
            lines = [ln.decode().rstrip("\n") for ln in r]
            took = time.monotonic() - t0
            conn.close()
            assert r.status == 200 and started < took / 2, (path, started, took)      # not after the prefill
            alive = [i for i, ln in enumerate(lines) if ln in (": keep-alive", "event: ping")]
            tokens = [i for i, ln in enumerate(lines) if '"text_delta"' in ln or "output_text.delta" in ln
                      or ('"delta": {"content": "' in ln and '"content": ""' not in ln)]
            assert alive and tokens and alive[0] < tokens[0], (path, lines[:12])
            whole = http_json(d, "POST", path, {**body, "stream": False})[1]
            assert _streamed_text(path, lines) == whole_text[path](whole), path
