"""llama-server's native routes and code infilling through a real daemon: `/completion` gives
the answer /v1/completions gives, in llama-server's shape; OpenAI's `suffix` (official client),
Ollama's `suffix` and llama-server's `/infill` each run exactly the prompt their product lays out
(the same answer as a raw completion of those tokens), whole and streamed; llama.vim's own
requests are answered; a model without FIM markers, and every field with no place, are refused
by name."""

import json
import shutil
import urllib.request

import openai
import pytest

from conftest import tiny_path
from daemon_harness import Daemon, http_json
from fim_model import build_fim_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PRE, SUF, MID, REP, SEP = 269, 270, 271, 273, 274
PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    home = tmp_path_factory.mktemp("infill")
    (home / "models").mkdir()
    coder = build_fim_model(tiny_path("qwen2"), home / "models" / "tiny-coder.gguf")
    shutil.copy(default_model_path, home / "models" / "smol.gguf")
    with Daemon(home, {"default": {"kind": "inference", "model": str(home / "models" / "smol.gguf")},
                       # a context past llama-server's 2048-token window leaves room for other files
                       "coder": {"kind": "inference", "model": str(coder), "settings": {"ctx": 4096}}}) as d:
        d.wait(lambda st: all(w["worker_state"] == "ready" for w in st["workers"]), timeout=90, what="models loaded")
        yield d


def enc(d, text: str) -> list[int]:
    status, out = http_json(d, "POST", "/tokenize", {"model": "coder", "content": text})
    assert status == 200, out
    return out["tokens"]


def raw(d, ids: list[int], n: int = 12) -> str:
    """The answer to exactly these prompt tokens."""
    status, out = http_json(d, "POST", "/v1/completions", {"model": "coder", "prompt": ids, "max_tokens": n,
                                                         "temperature": 0})
    assert status == 200, out
    return out["choices"][0]["text"]


def test_openai_suffix_runs_the_plain_fim_prompt(served):
    expected = raw(served, [PRE] + enc(served, PREFIX) + [SUF] + enc(served, SUFFIX) + [MID])
    client = openai.OpenAI(base_url=served.http + "/v1", api_key="unused", timeout=60)
    r = client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected and expected
    assert r.usage.prompt_tokens == 3 + len(enc(served, PREFIX)) + len(enc(served, SUFFIX))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == expected
    # an empty suffix is no suffix: a plain completion, as OpenAI and Ollama take it
    r = client.completions.create(model="coder", prompt=PREFIX, suffix="", max_tokens=12, temperature=0)
    assert r.choices[0].text == raw(served, enc(served, PREFIX))


def test_ollama_suffix_runs_the_same_prompt(served):
    expected = raw(served, [PRE] + enc(served, PREFIX) + [SUF] + enc(served, SUFFIX) + [MID])
    status, out = http_json(served, "POST", "/api/generate", {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX,
                                                             "stream": False, "options": {"temperature": 0,
                                                                                          "num_predict": 12}})
    assert status == 200 and out["response"] == expected, out
    # at the top of a file the prefix is empty: still an infill, not a model load
    expected = raw(served, [PRE, SUF] + enc(served, SUFFIX) + [MID])
    status, out = http_json(served, "POST", "/api/generate", {"model": "coder", "prompt": "", "suffix": SUFFIX,
                                                             "stream": False, "options": {"temperature": 0,
                                                                                          "num_predict": 12}})
    assert status == 200 and out["response"] == expected and out["done_reason"] in ("stop", "length"), out
    status, show = http_json(served, "POST", "/api/show", {"model": "tiny-coder"})
    assert status == 200 and "insert" in show["capabilities"], show
    status, smol = http_json(served, "POST", "/api/show", {"model": "smol"})
    assert status == 200 and "insert" not in smol["capabilities"], smol


def test_continue_finds_the_fim_model_and_its_context_as_it_does_with_ollama(served):
    """Continue (core/llm/llms/Ollama.ts) takes a model for FIM when /api/show's template holds
    `.Suffix`, and sends back the `num_ctx` of its parameters with every request."""
    status, show = http_json(served, "POST", "/api/show", {"name": "tiny-coder"})
    assert ".Suffix" in show["template"] and "<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>" in show["template"]
    assert show["parameters"] == "num_ctx 4096"          # the coder worker's context
    status, smol = http_json(served, "POST", "/api/show", {"name": "smol"})
    ctx = {m["name"]: m["context_length"] for m in http_json(served, "GET", "/api/ps")[1]["models"]}
    assert ".Suffix" not in smol["template"] and smol["parameters"] == f"num_ctx {ctx['smol:latest']}", (smol, ctx)
    # Continue's FIM request, as it builds it
    body = {"model": "tiny-coder", "prompt": PREFIX, "suffix": SUFFIX, "keep_alive": 1800, "stream": False,
            "options": {"temperature": 0, "top_p": 0.95, "num_predict": 12, "stop": ["\n\n", "<|endoftext|>"],
                        "num_ctx": 4096, "num_thread": 2, "use_mmap": True}}
    status, out = http_json(served, "POST", "/api/generate", body)
    assert status == 200 and out["done"] is True, out


def test_infill_runs_llama_servers_repo_level_prompt(served):
    extra = [{"filename": "util.py", "text": "def helper():\n    return 42\n"}]
    ids = ([REP] + enc(served, "myproject\n") + [SEP] + enc(served, "util.py\n") + enc(served, extra[0]["text"])
           + [SEP] + enc(served, "filename\n") + [PRE] + enc(served, PREFIX) + enc(served, " a")
           + [SUF] + enc(served, SUFFIX) + [MID])
    expected = raw(served, ids)
    body = {"model": "coder", "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": " a",
            "n_predict": 12, "temperature": 0, "cache_prompt": True, "return_tokens": True}
    status, out = http_json(served, "POST", "/infill", body)
    assert status == 200, out
    assert out["content"] == expected and out["stop"] is True and out["tokens_evaluated"] == len(ids)
    assert out["tokens_predicted"] == len(out["tokens"]) and out["stop_type"] in ("eos", "limit")
    assert out["timings"]["predicted_n"] == out["tokens_predicted"]
    # streamed: llama-server's native events, no [DONE]
    req = urllib.request.Request(served.http + "/infill", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == expected
    assert events[-1]["tokens_predicted"] == out["tokens_predicted"]


# what llama.vim (autoload/llama.vim) sends: other files ahead of time, then each completion
VIM_EXTRA = [{"text": "def helper():\n    return 42\n", "time": [1733, 2048], "filename": "util.py"},
             {"text": "CONSTANT = 7\n", "time": [1733, 4096], "filename": "const.py"}]
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def test_llama_vims_requests_are_answered_as_llama_server_answers_them(served):
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": VIM_EXTRA, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "stream": False, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""]}
    status, out = http_json(served, "POST", "/infill", {"model": "coder", **warm})
    assert status == 200 and out == {}, out           # nothing generated; no field asked for exists
    fim = {"input_prefix": "import util\n\n", "input_suffix": "\n", "input_extra": VIM_EXTRA,
           "prompt": "x = util.", "n_predict": 16, "n_indent": 0, "top_k": 40, "top_p": 0.99, "stream": False,
           "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
           "t_max_predict_ms": 1500, "response_fields": VIM_FIELDS}
    status, out = http_json(served, "POST", "/infill", {"model": "coder", **fim})
    assert status == 200 and set(out) == set(VIM_FIELDS), out
    # the other files were prefilled by the warm-up: only the cursor's part is new
    extra_tokens = 2 + len(enc(served, "myproject\n")) + sum(
        len(enc(served, c["filename"] + "\n")) + len(enc(served, c["text"])) + 1 for c in VIM_EXTRA)
    assert out["tokens_cached"] >= extra_tokens - 1, (out, extra_tokens)
    assert out["timings/predicted_n"] <= 16 and isinstance(out["content"], str)
    # the chain draws at random: with a seed, the same answer again
    seeded = dict(fim, seed=11, response_fields=["content", "tokens"], return_tokens=True)
    first = http_json(served, "POST", "/infill", {"model": "coder", **seeded})[1]
    assert http_json(served, "POST", "/infill", {"model": "coder", **seeded})[1] == first
    # the infill sampler compares every pair of candidates: over a whole vocabulary it would
    # never finish, so a chain without top_k before it is refused
    status, out = http_json(served, "POST", "/infill", {"model": "coder", **dict(fim, samplers=["top_p", "infill"],
                                                                                 top_k=None)})
    assert status == 400, out
    status, out = http_json(served, "POST", "/infill", {"model": "coder", "input_prefix": "x",
                                                        "samplers": ["infill"]})
    assert status == 400 and "top_k" in out["error"]["message"], out


def test_a_model_without_fim_markers_is_refused_by_name(served):
    status, out = http_json(served, "POST", "/v1/completions", {"model": "default", "prompt": "a", "suffix": "b"})
    assert status == 400 and "fill-in-the-middle" in out["error"]["message"] and "smol" in out["error"]["message"]
    status, out = http_json(served, "POST", "/infill", {"model": "default", "input_prefix": "a", "input_suffix": "b"})
    assert status == 400 and "fill-in-the-middle" in out["error"]["message"]
    status, out = http_json(served, "POST", "/api/generate", {"model": "smol", "prompt": "a", "suffix": "b",
                                                             "stream": False})
    assert status == 400 and "fill-in-the-middle" in out["error"], out       # Ollama's error shape


def test_completion_is_the_completions_answer_in_llama_servers_shape(served):
    q = "The capital of France is"
    status, ref = http_json(served, "POST", "/v1/completions", {"prompt": q, "max_tokens": 12, "temperature": 0})
    assert status == 200, ref
    status, out = http_json(served, "POST", "/completion", {"prompt": q, "n_predict": 12, "temperature": 0,
                                                            "return_tokens": True})
    assert status == 200 and out["content"] == ref["choices"][0]["text"] and out["stop"] is True, out
    # without return_tokens, no ids (llama-server's default)
    assert http_json(served, "POST", "/completion", {"prompt": q, "n_predict": 12, "temperature": 0})[1]["tokens"] == []
    assert out["tokens_evaluated"] == ref["usage"]["prompt_tokens"] and out["tokens_predicted"] == len(out["tokens"])
    assert out["stop_type"] == ("limit" if ref["choices"][0]["finish_reason"] == "length" else "eos")
    # token ids, and the stream: llama-server's events, no [DONE]
    ids = enc_default(served, q)
    assert http_json(served, "POST", "/completion", {"prompt": ids, "n_predict": 12,
                                                     "temperature": 0})[1]["content"] == out["content"]
    req = urllib.request.Request(served.http + "/completion", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": q, "n_predict": 12, "temperature": 0,
                                                  "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    assert "".join(e["content"] for e in events) == out["content"] and events[-1]["stop"] and "data: [DONE]" not in lines
    # a stop string: stop_type "word", the word named, the text before it
    word = out["content"].strip().split()[0]
    status, cut = http_json(served, "POST", "/completion", {"prompt": q, "n_predict": 12, "temperature": 0,
                                                            "stop": [word]})
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word and word not in cut["content"], cut


def test_n_probs_gives_the_completions_logprobs_in_llama_servers_shape(served):
    """A field added after the redesign (issue 36): n_probs, as /v1/completions' logprobs — the
    same tokens, log-probabilities and alternatives, whole and streamed."""
    q = "The capital of France is"
    status, ref = http_json(served, "POST", "/v1/completions", {"prompt": q, "max_tokens": 6, "temperature": 0,
                                                                "logprobs": 3})
    assert status == 200, ref
    lp = ref["choices"][0]["logprobs"]
    want = [(t, v, sorted(top.items())) for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]

    def said(probs):
        return [(p["token"], p["logprob"], sorted((a["token"], a["logprob"]) for a in p["top_logprobs"])) for p in probs]
    body = {"prompt": q, "n_predict": 6, "temperature": 0, "n_probs": 3, "return_tokens": True}
    status, out = http_json(served, "POST", "/completion", body)
    assert status == 200 and said(out["completion_probabilities"]) == want, out
    assert [p["id"] for p in out["completion_probabilities"]] == out["tokens"]
    assert all(p["bytes"] == list(p["token"].encode()) for p in out["completion_probabilities"])
    req = urllib.request.Request(served.http + "/completion", headers={"Content-Type": "application/json"},
                                 data=json.dumps({**body, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [json.loads(x[6:]) for x in r.read().decode().splitlines() if x.startswith("data: ")]
    assert said([p for e in events for p in e.get("completion_probabilities", [])]) == want
    # n_probs 0 (what llama.cpp's web UI sends): nothing more
    assert "completion_probabilities" not in http_json(served, "POST", "/completion", {**body, "n_probs": 0})[1]


YES_NO = 'root ::= answer "."\nanswer ::= "yes" | "no"'


def test_a_gbnf_grammar_or_a_json_schema_constrains_every_route(served):
    q = "Is the sky green? Answer:"
    status, out = http_json(served, "POST", "/completion", {"prompt": q, "n_predict": 8, "grammar": YES_NO})
    assert status == 200 and out["content"] in ("yes.", "no.") and out["stop_type"] == "eos", out
    status, out = http_json(served, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Is the sky green?"}], "max_tokens": 8, "grammar": YES_NO})
    assert status == 200 and out["choices"][0]["message"]["content"] in ("yes.", "no."), out
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    status, out = http_json(served, "POST", "/v1/completions", {"prompt": "A number as JSON:", "max_tokens": 16,
                                                              "temperature": 0, "json_schema": schema})
    assert status == 200 and isinstance(json.loads(out["choices"][0]["text"])["n"], int), out
    status, out = http_json(served, "POST", "/infill", {"model": "coder", "input_prefix": "x = ", "n_predict": 8,
                                                        "grammar": 'root ::= [0-9]+'})
    assert status == 200 and out["content"].isdigit(), out
    # one that does not compile: a 400 with the reason
    status, out = http_json(served, "POST", "/completion", {"prompt": q, "grammar": "root ::= missing"})
    assert status == 400 and "grammar" in out["error"]["message"] and "missing" in out["error"]["message"], out


def test_the_tokenizer_routes_take_llama_servers_fields_and_defaults(served):
    text = "<|im_start|>user\nnaïve"
    parsed = http_json(served, "POST", "/tokenize", {"content": text})[1]["tokens"]
    plain = http_json(served, "POST", "/tokenize", {"content": text, "parse_special": False})[1]["tokens"]
    assert parsed[0] == 1 and 1 not in plain            # special-token text parsed by default, as llama-server
    # SmolLM2 asks for no BOS: add_special adds none
    assert http_json(served, "POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"] == parsed
    pieces = http_json(served, "POST", "/tokenize", {"content": text, "with_pieces": True})[1]["tokens"]
    assert [p["id"] for p in pieces] == parsed and pieces[0] == {"id": 1, "piece": "<|im_start|>"}
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text                       # a piece that is not UTF-8 alone comes as its bytes
    assert http_json(served, "POST", "/detokenize", {"tokens": parsed})[1]["content"] == text
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    status, out = http_json(served, "POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}],
                                                               "tools": [weather]})
    assert status == 200 and "get_weather" in out["prompt"], out
    status, out = http_json(served, "POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}],
                                                               "add_generation_prompt": False})
    assert status == 200 and not out["prompt"].rstrip().endswith("assistant"), out
    for path, body, field in (("/tokenize", {"content": "a", "with_offsets": True}, "with_offsets"),
                              ("/tokenize", {"content": "a", "parse_special": "yes"}, "parse_special"),
                              ("/detokenize", {"tokens": [1], "skip_special": True}, "skip_special"),
                              ("/apply-template", {"messages": [], "continue_final_message": True},
                               "continue_final_message")):
        status, out = http_json(served, "POST", path, body)
        assert status == 400 and out["error"]["param"] == field, (path, out)


# what llama.vscode's chat edit (and the llama.cpp web UI) send to /v1/chat/completions: the
# whole parameter set, mostly at the values that turn a feature off
WEB_UI = {"stream": False, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0.8, "dynatemp_range": 0,
          "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1, "xtc_probability": 0,
          "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1, "presence_penalty": 0,
          "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
          "dry_penalty_last_n": -1, "max_tokens": -1, "timings_per_token": False}


def test_llama_servers_full_parameter_set_is_the_plain_request(served):
    """Its samplers are llama.cpp's default order, which is Kiln's chain; DRY, XTC and dynamic
    temperature are off: the same seeded answer as the request with the standard fields alone."""
    ask = {"messages": [{"role": "user", "content": "Name a fruit."}], "seed": 5}
    status, full = http_json(served, "POST", "/v1/chat/completions", {**ask, **WEB_UI, "max_tokens": 16})
    assert status == 200, full
    plain = {k: WEB_UI[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")}
    status, ref = http_json(served, "POST", "/v1/chat/completions", {**ask, **plain, "max_tokens": 16})
    assert full["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    # max_tokens -1: until the model stops (or the context ends), as llama-server
    status, out = http_json(served, "POST", "/v1/chat/completions", {**ask, **WEB_UI, "temperature": 0})
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
    # a chain that leaves out a sampler whose field is given: that field would do nothing
    status, out = http_json(served, "POST", "/v1/chat/completions", {**ask, **WEB_UI, "samplers": "kt"})
    assert status == 400 and out["error"]["param"] in ("top_p", "min_p", "typical_p", "repeat_penalty"), out


def test_props_tells_the_context_slots_template_and_whether_it_infills(served):
    status, props = http_json(served, "GET", "/props")
    assert status == 200 and props["total_slots"] == 4 and props["infill"] is False, props
    ctx = {m["name"]: m["context_length"] for m in http_json(served, "GET", "/api/ps")[1]["models"]}
    assert props["default_generation_settings"]["n_ctx"] == ctx["smol:latest"] and "im_start" in props["chat_template"]
    status, coder = http_json(served, "GET", "/props?model=coder")
    assert coder["infill"] is True and coder["default_generation_settings"]["n_ctx"] == 4096, coder


def enc_default(d, text: str) -> list[int]:
    status, out = http_json(d, "POST", "/tokenize", {"content": text, "add_special": True})
    assert status == 200, out
    return out["tokens"]


@pytest.mark.parametrize("path,body,field", [
    ("/completion", {"prompt": ["a", "b"]}, "prompt"),
    ("/completion", {"prompt": "a", "n_probs": 21}, "n_probs"),
    ("/completion", {"prompt": "a", "n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs"),
    ("/v1/completions", {"prompt": "a", "n_probs": 3}, "n_probs"),
    ("/completion", {"prompt": "a", "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": "a", "input_prefix": "x"}, "input_prefix"),
    ("/infill", {"input_prefix": "a", "samplers": ["top_k", "mystery"]}, "samplers"),
    ("/infill", {"input_prefix": "a", "samplers": "kqz"}, "samplers"),
    ("/infill", {"input_prefix": "a", "dry_multiplier": 0.8}, "dry_multiplier"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "xtc_probability": 0.5},
     "xtc_probability"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "timings_per_token": True},
     "timings_per_token"),
    ("/v1/completions", {"prompt": "a", "mirostat": 2}, "mirostat"),
    ("/v1/completions", {"prompt": "a", "repeat_last_n": -5}, "repeat_last_n"),
    ("/infill", {"input_prefix": "a", "samplers": ["top_k", "infill"], "temperature": 0.2}, "temperature"),
    ("/infill", {"input_prefix": "a", "n_indent": -1}, "n_indent"),
    ("/infill", {"input_prefix": "a", "t_max_predict_ms": "soon"}, "t_max_predict_ms"),
    ("/infill", {"input_prefix": "a", "response_fields": "content"}, "response_fields"),
    ("/infill", {"input_prefix": "a", "id_slot": 0}, "id_slot"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"name": "x", "text": "y"}]}, "input_extra[0]"),
    ("/infill", {"input_prefix": 3}, "input_prefix"),
    ("/infill", {"input_prefix": "a", "n_predict": -2}, "n_predict"),
    ("/v1/completions", {"prompt": ["a", "b"], "suffix": "c"}, "prompt"),
    ("/v1/completions", {"prompt": "a", "suffix": "c", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "a", "suffix": 3}, "suffix"),
    ("/api/generate", {"prompt": "a", "suffix": "b", "system": "be brief"}, "system"),
    ("/api/generate", {"prompt": "a", "suffix": "b", "raw": True}, "raw"),
    ("/api/generate", {"prompt": "a", "suffix": "b", "format": "json"}, "format"),
])
def test_what_an_infill_has_no_place_for_is_refused(served, path, body, field):
    status, out = http_json(served, "POST", path, {"model": "coder", **body})
    if path.startswith("/api/"):                       # Ollama's error shape: a message naming the field
        assert status == 400 and out["error"].startswith(f"{field} "), out
    else:
        assert status == 400 and out["error"].get("param") == field, out
