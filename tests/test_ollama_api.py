"""Ollama's API through a real daemon with the official `ollama` client: list, show, ps, chat
(stream and not: the same text at temperature 0), generate, embed and the legacy embeddings,
format with a schema, tools, pull of a model already here, copy and delete, a model created from
a Modelfile, and errors in Ollama's shape."""

import json
import urllib.error
import urllib.request

import jsonschema
import ollama
import pytest

from daemon_harness import Daemon, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("ollama")
    (home / "models").mkdir()
    (home / "models" / "smol.gguf").symlink_to(default_model_path)
    with Daemon(home, {"default": {"kind": "inference", "model": str(home / "models" / "smol.gguf")}}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=60, what="model loaded")
        yield d


@pytest.fixture
def client(served):
    return ollama.Client(host=served.http, timeout=120)


def test_list_show_and_ps(client, served):
    names = [m.model for m in client.list().models]
    assert "smol:latest" in names
    m = next(m for m in client.list().models if m.model == "smol:latest")
    assert m.details.family == "llama" and m.size > 50_000_000
    shown = client.show("smol")
    assert shown.details.family == "llama" and "im_start" in shown.template
    assert "llama.context_length" in shown.modelinfo and "tokenizer.ggml.tokens" not in shown.modelinfo
    # verbose: the vocabulary too, as Ollama's; a field /api/show does not know is refused
    verbose = http_json(served, "POST", "/api/show", {"model": "smol", "verbose": True})[1]
    assert verbose["model_info"]["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    status, out = http_json(served, "POST", "/api/show", {"model": "smol", "system": "x"})
    assert status == 400 and "system" in out["error"], out
    status, out = http_json(served, "POST", "/api/pull", {"model": "smol", "insecure": True})
    assert status == 400 and "insecure" in out["error"], out
    loaded = {p.model: p for p in client.ps().models}
    assert "smol:latest" in loaded
    running = loaded["smol:latest"]                   # the same file's facts as the listing's
    assert running.size >= m.size                     # the memory it is given: weights and KV cache
    assert running.details.family == "llama" and running.details.quantization_level == m.details.quantization_level
    assert running.digest == m.digest


def test_chat_stream_equals_whole_at_temperature_zero(client, served):
    opts = {"temperature": 0, "num_predict": 24}
    whole = client.chat(model="smol", messages=ASK, options=opts)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.eval_count >= 1
    assert whole.total_duration > 0 and whole.prompt_eval_count > 5
    parts, last = [], None
    for chunk in client.chat(model="smol", messages=ASK, options=opts, stream=True):
        parts.append(chunk.message.content)
        last = chunk
    assert last.done and "".join(parts) == whole.message.content
    # the same answer as the OpenAI route gives for the same request
    req = urllib.request.Request(served.http + "/v1/chat/completions", method="POST", data=json.dumps(
        {"model": "smol", "messages": ASK, "temperature": 0, "max_tokens": 24}).encode())
    oa = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert oa["choices"][0]["message"]["content"] == whole.message.content


def test_logprobs_are_the_openai_routes_in_ollamas_shape(client, served):
    """A field added after the redesign (issue 36): logprobs and top_logprobs, through the official
    client, as the OpenAI chat route's — the same tokens, log-probabilities and alternatives."""
    opts = {"temperature": 0, "num_predict": 8}
    status, oa = http_json(served, "POST", "/v1/chat/completions", {"model": "smol", "messages": ASK, "temperature": 0,
                                                                    "max_tokens": 8, "logprobs": True, "top_logprobs": 3})
    assert status == 200, oa
    want = [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
            for t in oa["choices"][0]["logprobs"]["content"]]

    def said(lps):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs or []]) for t in lps]
    whole = client.chat(model="smol", messages=ASK, options=opts, logprobs=True, top_logprobs=3)
    assert said(whole.logprobs) == want and whole.eval_count == len(want)
    streamed = [t for c in client.chat(model="smol", messages=ASK, options=opts, logprobs=True, top_logprobs=3,
                                       stream=True) for t in (c.logprobs or [])]
    assert said(streamed) == want
    # logprobs alone: each token's own, no alternatives; none unless asked
    only = client.chat(model="smol", messages=ASK, options=opts, logprobs=True)
    assert [(t.token, t.logprob) for t in only.logprobs] == [(t, v) for t, v, _ in want]
    assert not client.chat(model="smol", messages=ASK, options=opts).logprobs
    status, out = http_json(served, "POST", "/api/generate", {"model": "smol", "prompt": "hi", "top_logprobs": 2})
    assert status == 400 and "logprobs" in out["error"], out


def test_a_created_model_answers_as_its_base_with_its_fields_given_by_hand(client, served, default_model, tmp_path):
    """A Modelfile's SYSTEM, PARAMETER temperature 0 and ADAPTER (through the official client's
    create, and `kiln models create -f`): the created model's answer is the base model's with
    those fields given by hand; listed, shown as a Modelfile, copied and deleted as a manifest."""
    import numpy as np
    from daemon_harness import kiln
    from kiln.native.lora import LoraConfig, init_adapter, save_adapter
    rng = np.random.default_rng(7)
    ad = init_adapter(default_model, LoraConfig(), rng)
    for _, b in ad.tensors.values():
        b[...] = rng.normal(0, 0.5, size=b.shape).astype(np.float32)      # strong enough to change the answer
    (served.home / "adapters").mkdir(exist_ok=True)
    save_adapter(ad, served.home / "adapters" / "rnd.gguf", "rnd")
    system = "You are a pirate. Answer in one short sentence."
    r = client.create(model="pirate", from_="smol", system=system, parameters={"temperature": 0, "num_predict": 12},
                      adapters={"rnd": ""})
    assert r.status == "success"
    ask = [{"role": "user", "content": "Where is the treasure?"}]
    created = client.chat(model="pirate", messages=ask)
    by_hand = {"model": "smol", "messages": [{"role": "system", "content": system}] + ask, "temperature": 0,
               "max_tokens": 12}
    status, with_adapter = http_json(served, "POST", "/v1/chat/completions", {**by_hand, "adapter": "rnd"})
    assert status == 200, with_adapter
    assert created.message.content == with_adapter["choices"][0]["message"]["content"]
    assert created.model == "pirate" and created.eval_count == with_adapter["usage"]["completion_tokens"]
    status, without = http_json(served, "POST", "/v1/chat/completions", by_hand)
    assert without["choices"][0]["message"]["content"] != created.message.content, "the adapter must apply"
    # a request's own fields win: its system message replaces SYSTEM
    mine = client.chat(model="pirate", messages=[{"role": "system", "content": "Be terse."}] + ask)
    _, ref = http_json(served, "POST", "/v1/chat/completions", {**by_hand, "adapter": "rnd", "messages": [
        {"role": "system", "content": "Be terse."}] + ask})
    assert mine.message.content == ref["choices"][0]["message"]["content"]
    # listed, shown, copied and deleted as a manifest; the base stays
    assert "pirate:latest" in [m.model for m in client.list().models]
    shown = client.show("pirate")
    assert "FROM smol" in shown.modelfile and "PARAMETER temperature 0" in shown.modelfile and "ADAPTER rnd" in shown.modelfile
    assert system in shown.modelfile and shown.details.family == "llama"
    client.copy("pirate", "pirate2")
    assert client.chat(model="pirate2", messages=ask).message.content == created.message.content
    client.delete("pirate2")
    assert "pirate2:latest" not in [m.model for m in client.list().models] and "smol:latest" in [
        m.model for m in client.list().models]
    # the CLI makes the same model from a Modelfile
    mf = tmp_path / "Modelfile"
    mf.write_text(f'# a pirate\nFROM smol\nPARAMETER temperature 0\nPARAMETER num_predict 12\nADAPTER rnd\n'
                  f'SYSTEM """{system}"""\n')
    r = kiln(served.home, "models", "create", "pirate-cli", "-f", str(mf))
    assert r.returncode == 0, r.stderr
    assert client.chat(model="pirate-cli", messages=ask).message.content == created.message.content
    # what cannot be done as written is refused, naming it
    for body, words in (({"from": "smol", "template": "{{ .Prompt }}"}, "Go templates"),
                        ({"from": "smol", "parameters": {"mirostat": 2}}, "'mirostat' is not supported"),
                        ({"from": "nope"}, "no such model"),
                        ({"from": "smol", "adapters": {"missing": ""}}, "no adapter named 'missing'"),
                        ({"modelfile": "FROM smol\nPARAMETER temperature 9"}, "out of range")):
        status, out = http_json(served, "POST", "/api/create", {"model": "bad", "stream": False, **body})
        assert status == 400 and words in out["error"], (body, out)


def test_generate_and_embed(client):
    r = client.generate(model="smol", prompt="Say hello.", options={"temperature": 0, "num_predict": 8})
    assert r.done and r.response.strip()
    e = client.embed(model="smol", input=["The cat sat.", "Markets fell."])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) == 576


def test_legacy_embeddings_are_the_unnormalised_mean_of_embeds_direction(client):
    import numpy as np
    old = np.array(client.embeddings(model="smol", prompt="The cat sat.").embedding)
    new = np.array(client.embed(model="smol", input="The cat sat.").embeddings[0])
    assert old.shape == (576,) and abs(np.linalg.norm(new) - 1) < 1e-5
    assert abs(np.linalg.norm(old) - 1) > 0.01                    # not normalised, as Ollama's legacy route
    assert np.allclose(old / np.linalg.norm(old), new, atol=1e-5)
    assert client.embeddings(model="smol", prompt="").embedding == []       # loads the model
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="smol", input="x", options={"temperature": 0.5})
    assert e.value.status_code == 400 and "temperature" in e.value.error and "no effect" in e.value.error
    client.embed(model="smol", input="x", options={"num_thread": 2, "num_ctx": 512})   # Kiln's to decide; fits
    with pytest.raises(ollama.ResponseError) as e:
        client.embeddings(model="smol", prompt="x", options={"num_ctx": 10 ** 6})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


def test_copy_then_delete_and_what_is_refused(client, served):
    import os
    models = served.home / "models"
    client.copy("smol", "smol-copy")
    assert os.path.samefile(models / "smol-copy.gguf", models / "smol.gguf")      # a link, not a second copy
    assert "smol-copy:latest" in [m.model for m in client.list().models]
    r = client.generate(model="smol-copy", prompt="Say hello.", options={"temperature": 0, "num_predict": 4})
    assert r.done
    with pytest.raises(ollama.ResponseError) as e:
        client.copy("smol", "smol-copy")
    assert e.value.status_code == 400 and "exists" in e.value.error
    # smol-copy now has a worker (the request above loaded it): deleting it is refused until unloaded
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("smol-copy")
    assert e.value.status_code == 409 and "in use" in e.value.error
    served.command("unload", {"model": "smol-copy"})
    served.wait(lambda st: not any(w["name"] != "default" and w["pid"] for w in st["workers"]
                                   if w["kind"] == "inference"), timeout=60, what="smol-copy unloaded")
    client.delete("smol-copy")
    assert not (models / "smol-copy.gguf").exists() and (models / "smol.gguf").exists()
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("smol-copy")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.push("smol")
    assert e.value.status_code == 501 and "Kiln" in e.value.error


def test_format_schema_and_json(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    r = client.chat(model="smol", messages=[{"role": "user", "content": "Give a city as JSON."}], format=schema,
                    options={"temperature": 0.7, "seed": 3, "num_predict": 100})
    jsonschema.validate(json.loads(r.message.content), schema)
    r = client.generate(model="smol", prompt="Return a JSON object with a cat's name and age.", format="json",
                        options={"temperature": 0, "num_predict": 100})
    assert isinstance(json.loads(r.response), dict)


def test_tools_come_back_as_ollama_tool_calls(client, served):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    # Ollama has no tool_choice: the model decides; whatever it answers must be a valid shape
    r = client.chat(model="smol", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                    options={"temperature": 0, "num_predict": 60})
    for c in r.message.tool_calls or []:
        assert isinstance(c.function.arguments, dict)
    follow = client.chat(model="smol", options={"temperature": 0, "num_predict": 20}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                         "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"}], tools=[tool])
    assert follow.done


def test_pull_of_a_model_already_here_succeeds(client):
    statuses = [p.status for p in client.pull("smol", stream=True)]
    assert statuses[-1] == "success"


def test_errors_are_in_ollamas_shape(client, served):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=ASK)
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="smol", messages=ASK, options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    # mirostat 0 is off (what Kiln does); repeat_last_n is llama.cpp's window of the penalties
    r = client.chat(model="smol", messages=ASK, options={"mirostat": 0, "repeat_last_n": 32, "num_predict": 4})
    assert r.done
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="smol", prompt="hi", images=["aGk="])
    assert e.value.status_code == 400 and "images[0]: not an image Kiln reads" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="smol", prompt="hi", context=[1, 2, 3])
    assert e.value.status_code == 400 and "context" in e.value.error
    # empty ones say nothing: accepted, as clients send them
    req = urllib.request.Request(served.http + "/api/generate", method="POST", data=json.dumps(
        {"model": "smol", "prompt": "hi", "images": [], "context": [], "stream": False,
         "options": {"num_predict": 2}}).encode())
    assert json.loads(urllib.request.urlopen(req, timeout=60).read())["done"]
    req = urllib.request.Request(served.http + "/api/chat", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    assert set(json.loads(he.value.read())) == {"error"}
    assert json.loads(urllib.request.urlopen(served.http + "/api/version", timeout=30).read())["version"]


def test_create_with_quantize_writes_llama_cpps_bytes_under_the_new_name(client, served):
    """Ollama's create with `quantize`: the base (F16 here) written in that type — the bytes
    llama.cpp's quantizer writes (tests/data/quantize.json) — streamed as Ollama's status lines;
    with a system prompt too, a created model over the quantized file."""
    import hashlib
    from pathlib import Path

    from quant_models import INPUTS
    models = served.home / "models"
    src = INPUTS["llama-f16-tied"](models / "tiny-f16.gguf")
    ref = json.loads((Path(__file__).parent / "data" / "quantize.json").read_text())
    events = list(client.create(model="tiny-q4", from_="tiny-f16", quantize="q4_K_M", stream=True))
    assert events[0].status == "quantizing tiny-f16.gguf to Q4_K_M" and events[-1].status == "success", events
    assert events[-3].completed == events[-3].total > 0
    digest = hashlib.sha256((models / "tiny-q4.gguf").read_bytes()).hexdigest()
    if hashlib.sha256(src.read_bytes()).hexdigest() == ref["inputs"]["llama-f16-tied"]:
        assert digest == ref["outputs"]["llama-f16-tied.Q4_K_M"]
    assert "tiny-q4:latest" in [m.model for m in client.list().models]
    assert client.show("tiny-q4").details.quantization_level == "Q4_K"
    r = client.create(model="tiny-sys", from_="tiny-f16", quantize="Q8_0", system="Be brief.")
    assert r.status == "success" and (models / "tiny-sys-q8_0.gguf").exists()
    assert "SYSTEM" in client.show("tiny-sys").modelfile and "Be brief." in client.show("tiny-sys").modelfile
    for body, words in (({"from": "smol", "quantize": "q4_K_M"}, "is Q4_1 already"),
                        ({"from": "tiny-f16", "quantize": "iq2_xxs"}, "not a type Kiln writes"),
                        ({"from": "tiny-f16", "quantize": "q4_K_M", "model": "tiny-q4"}, "is a model file already")):
        status, out = http_json(served, "POST", "/api/create", {"model": "bad", "stream": False, **body})
        assert status == 400 and words in out["error"], (body, out)
    assert not (models / "bad.gguf").exists()
