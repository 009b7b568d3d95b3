"""The agent-facing API through a real daemon on the default model, with the official `openai`
client: forced tool calls (plain and streamed), a tool result answered, structured outputs held
to their schema, refused fields, embeddings, /metrics and the request log."""

import base64
import json
import urllib.request

import jsonschema
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_harness import Daemon

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("agent")
    with Daemon(home, {"default": {"kind": "inference", "model": str(default_model_path)}}) as d:
        d.wait(lambda st: st["workers"][0]["state"] == "running" and st["workers"][0]["worker_state"] == "ready",
               timeout=60, what="model loaded")
        yield d


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.http + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid_call(call, tool):
    assert call.type == "function" and call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_tool_choice_gives_a_valid_call(client):
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.tool_calls, ch.message
    for call in ch.message.tool_calls:
        assert call.id.startswith("call_")
        _valid_call(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])


def test_named_tool_choice_streamed_assembles_to_the_same_call(client):
    kw = dict(model="default", messages=ASK, tools=[WEATHER, TIME], temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
    _valid_call(whole.message.tool_calls[0], WEATHER)

    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                c["id"] = d.id or c["id"]
                if d.function and d.function.name:
                    c["name"] = d.function.name
                if d.function and d.function.arguments:
                    c["arguments"] += d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)]


def test_a_tool_result_sent_back_gets_an_answer(client):
    first = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0).choices[0].message
    call = first.tool_calls[0]
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    r = client.chat.completions.create(model="default", messages=msgs, tools=[WEATHER], max_tokens=40, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert (ch.message.content or "").strip() or ch.message.tool_calls


def test_json_schema_strict_holds_at_temperature(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                        "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    for seed in range(3):
        r = client.chat.completions.create(
            model="default", temperature=0.7, seed=seed, max_tokens=200,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_parses(client):
    r = client.chat.completions.create(model="default", temperature=0, max_tokens=300,
                                       messages=[{"role": "user", "content": "Return a JSON object with a cat's name and age."}],
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"n": 0}, "n"),
])
def test_bad_or_unknown_fields_are_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_a_schema_llguidance_refuses_is_400_and_the_worker_lives(client, served):
    before = served.status()["workers"][0]["pid"]
    bad = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["x"]}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert "response_format" in e.value.body["message"]
    assert served.status()["workers"][0]["pid"] == before
    assert client.chat.completions.create(model="default", messages=ASK, max_tokens=2).choices[0].message


def test_n_sequences_share_the_prompt_and_are_deterministic_with_a_seed(client):
    kw = dict(model="default", messages=ASK, max_tokens=12, temperature=1.0, seed=7, n=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    one = client.chat.completions.create(**dict(kw, n=1))
    assert a.usage.prompt_tokens == one.usage.prompt_tokens          # the prompt counted once
    assert 3 <= a.usage.completion_tokens <= 36
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in a.choices]


def test_logit_bias_forbids_and_forces_tokens(client, served):
    plain = client.chat.completions.create(model="default", messages=ASK, max_tokens=6, temperature=0,
                                           logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    ids = json.loads(urllib.request.urlopen(urllib.request.Request(
        served.http + "/tokenize", data=json.dumps({"content": first}).encode(), method="POST"),
        timeout=30).read())["tokens"]
    banned = client.chat.completions.create(model="default", messages=ASK, max_tokens=6, temperature=0,
                                            logprobs=True, logit_bias={str(ids[0]): -100})
    assert banned.choices[0].logprobs.content[0].token != first


def test_embeddings_two_strings_float_and_base64(client, served):
    r = client.embeddings.create(model="default", input=["The cat sat on the mat.", "Stock markets fell today."])
    assert [d.index for d in r.data] == [0, 1]
    a, b = (np.array(d.embedding, np.float32) for d in r.data)
    assert a.shape == (576,) and abs(np.linalg.norm(a) - 1) < 1e-5 and abs(np.linalg.norm(b) - 1) < 1e-5
    assert r.usage.prompt_tokens > 8
    same = client.embeddings.create(model="default", input="The cat sat on the mat.", encoding_format="float")
    assert np.array_equal(np.array(same.data[0].embedding, np.float32), a)     # the client asked base64 first
    b64 = client.embeddings.create(model="default", input="The cat sat on the mat.", encoding_format="base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4"), a)
    near = client.embeddings.create(model="default", input="A cat was sitting on the mat.").data[0].embedding
    assert float(a @ np.array(near, np.float32)) > float(a @ b)
    short = np.array(client.embeddings.create(model="default", input="The cat sat on the mat.",
                                              dimensions=64).data[0].embedding, np.float32)
    assert short.shape == (64,) and abs(np.linalg.norm(short) - 1) < 1e-5           # cut, then normalised
    assert np.allclose(short, a[:64] / np.linalg.norm(a[:64]), atol=1e-6)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="default", input="x", dimensions=577)
    assert "576" in e.value.body["message"]


def test_metrics_parse_and_count_what_was_served(client, served):
    client.chat.completions.create(model="default", messages=ASK, max_tokens=3)
    text = urllib.request.urlopen(served.http + "/metrics", timeout=30).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kiln_requests", "kiln_tokens", "kiln_time_to_first_token_seconds", "kiln_inter_token_seconds",
                 "kiln_queue_depth", "kiln_worker_restarts", "kiln_worker_rss_bytes", "kiln_kv_cache_bytes",
                 "kiln_request_duration_seconds", "kiln_worker_up"):
        assert name in families, sorted(families)
    served_ok = [s for s in families["kiln_requests"].samples
                 if s.labels.get("route") == "/v1/chat/completions" and s.labels.get("status") == "200"
                 and s.name.endswith("_total")]
    assert served_ok and served_ok[0].value >= 1
    out = [s for s in families["kiln_tokens"].samples if s.labels.get("direction") == "out" and s.name.endswith("_total")]
    assert out[0].value >= 3


def test_every_request_is_a_line_in_the_daemon_log(client, served):
    # the harness runs the daemon in the foreground: its log is daemon.out (`kiln up` detached
    # writes the same lines to logs/kiln.log, which `kiln logs kiln` shows)
    log = served.home / "daemon.out"

    def lines():
        return [ln for ln in log.read_text().splitlines() if "request POST /v1/chat/completions" in ln]
    before, usage = len(lines()), None
    for chunk in client.chat.completions.create(model="default", messages=ASK, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    # the line is written once the server has ended the stream, which may be after the client
    # read its last chunk: wait for it (the model may also stop before max_tokens)
    served.wait(lambda _: len(lines()) > before, what="the streamed request's log line")
    last = lines()[-1]
    for part in ("status=200", "model=default", "prompt_tokens=", f"completion_tokens={usage.completion_tokens}",
                 "ttft_ms=", "total_ms="):
        assert part in last, last
    # `kiln run` (the control socket) is a line too (issue 42: it was missing)
    from daemon_harness import kiln

    def runs():
        return [ln for ln in log.read_text().splitlines() if "request control generate" in ln]
    before = len(runs())
    r = kiln(served.home, "run", "--max-tokens", "4", "-t", "0", "Hi")
    assert r.returncode == 0, r.stderr
    served.wait(lambda _: len(runs()) > before, what="kiln run's log line")
    assert "status=ok" in runs()[-1] and "completion_tokens=" in runs()[-1] and "total_ms=" in runs()[-1], runs()[-1]


def test_speculation_is_reported_and_can_be_turned_off(client):
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    msgs = [{"role": "user", "content": f"Repeat this code exactly:\n\n{code}"}]
    on = client.chat.completions.create(model="default", messages=msgs, max_tokens=60, temperature=0)
    off = client.chat.completions.create(model="default", messages=msgs, max_tokens=60, temperature=0,
                                         extra_body={"speculative": False})
    assert on.choices[0].message.content == off.choices[0].message.content
    assert off.usage.completion_tokens_details is None or not off.usage.completion_tokens_details.accepted_prediction_tokens
    d = on.usage.completion_tokens_details
    assert d is not None and d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0
