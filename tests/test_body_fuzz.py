"""No 5xx from a body (issue 35): 1,000+ hostile bodies across every route that reads one — each
answered, none with a server error. Bodies are a route's valid request with one field (or the
whole) replaced by something hostile: wrong types, lone surrogates, 5,000-character names, deep
nesting, huge numbers, unknown fields, raw bytes that are not JSON. Fixed seed, bounded count."""

import http.client
import json
import random
import time

import pytest

from conftest import DATA, tiny_path
from daemon_harness import Daemon

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SEED, COUNT = 35, 1100
MSGS = [{"role": "user", "content": "hi"}]
# (method, path, a valid body): every route that reads a body, but the ones that change the daemon
# by design when given a valid one (worker and model actions, pull, delete: their bodies are only
# `{}` or a flag, tested in test_http_foundation and test_request_paths)
ROUTES = [
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 4, "temperature": 0}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stop": ["x"]}),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": ["hi", "there"]}),
    ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4}),
    ("POST", "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": MSGS, "system": "s"}),
    ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": MSGS}),
    ("POST", "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 4}}),
    ("POST", "/api/chat", {"model": "tiny", "messages": MSGS, "stream": False, "options": {"num_predict": 4}}),
    ("POST", "/api/embed", {"model": "tiny", "input": "hi"}),
    ("POST", "/api/embeddings", {"model": "tiny", "prompt": "hi"}),
    ("POST", "/api/show", {"model": "tiny"}),
    ("POST", "/api/copy", {"source": "tiny", "destination": "tiny-copy"}),
    ("POST", "/completion", {"prompt": "hi", "n_predict": 4}),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 4}),
    ("POST", "/tokenize", {"content": "hi", "with_pieces": True}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("POST", "/apply-template", {"messages": MSGS}),
    ("POST", "/v1/rerank", {"model": "ranker", "query": "q", "documents": ["a", "b"], "top_n": 1}),
    ("POST", "/rerank", {"model": "ranker", "query": "q", "texts": ["a"], "return_text": True}),
    ("POST", "/embedding", {"model": "ranker", "content": "hi", "embd_normalize": 2}),
    ("POST", "/embedding", {"model": "tiny", "content": ["hi", [1, 2]]}),
    ("POST", "/v1/train/sft", {"adapter": "fz", "data": '{"messages": []}\n'}),
    ("POST", "/v1/eval/run", {"inline": {"name": "s", "examples": [{"prompt": "1+1", "answer": "2"}]}}),
]

SURROGATE = "\ud800"


def hostile(rng: random.Random):
    """One hostile JSON value."""
    pool = [
        "abc", "", SURROGATE, "a" * 5000, "x" * 200_000, "\x00", "../../etc/passwd", "/dev/zero", "tiny\n",
        -1, 0, 2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 0.5, True, False, None,
        [], {}, [None], [SURROGATE], {"": SURROGATE}, {SURROGATE: 1}, [[[[[]]]]], {"a": {"b": {"c": []}}},
        ["a" * 100] * 100, list(range(1000)), [{"role": "user"}], [{"role": 5, "content": []}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}], [{"role": "tool", "content": "x"}],
        {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, {"num_predict": "x"},
    ]
    v = rng.choice(pool)
    if rng.random() < 0.1:                              # deeper than any API nests
        for _ in range(rng.choice([65, 200])):
            v = [v] if rng.random() < 0.5 else {"k": v}
    return v


def mutate(rng: random.Random, body: dict):
    b = json.loads(json.dumps(body))
    r = rng.random()
    if r < 0.08:
        return hostile(rng)                             # the whole body: not an object, or odd
    keys = list(b)
    if r < 0.55 and keys:
        b[rng.choice(keys)] = hostile(rng)
    elif r < 0.65 and keys:
        del b[rng.choice(keys)]
    elif r < 0.75:
        b[rng.choice(["options", "tools", "stream", "stop", "seed", "n", "logprobs", "samplers", "format",
                      "response_format", "tool_choice", "max_tokens", "temperature", "top_k", "grammar",
                      "suffix", "images", "keep_alive", "adapter", "unknown_field", SURROGATE])] = hostile(rng)
    else:                                               # inside a nested value
        for k in keys:
            if isinstance(b[k], list) and b[k] and isinstance(b[k][0], dict):
                inner = b[k][0]
                inner[rng.choice(list(inner) + ["extra"])] = hostile(rng)
                break
            if isinstance(b[k], dict) and b[k]:
                b[k][rng.choice(list(b[k]))] = hostile(rng)
                break
        else:
            b["x"] = hostile(rng)
    return b


RAW = [b"{", b"\xff\xfe{}", b'{"model": "tiny", "messages": ', b"[" * 5000 + b"]" * 5000,
       b'{"a": 1e999999}', b'{"a": NaN}', b'{"model": "\\ud800"}', b"null", b"\"text\"", b"{\"a\":1,\"a\":2}"]


def send(conn_to, method, path, raw: bytes):
    host, port = conn_to
    c = http.client.HTTPConnection(host, port, timeout=60)
    try:
        c.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    home = tmp_path_factory.mktemp("fuzz")
    (home / "models").mkdir()
    import shutil
    shutil.copyfile(tiny_path("llama"), home / "models" / "tiny.gguf")
    shutil.copyfile(DATA / "tiny" / "tiny-bert-rerank.gguf", home / "models" / "ranker.gguf")
    workers = {"tiny": {"kind": "inference", "model": str(home / "models" / "tiny.gguf"), "settings": {"ctx": 256}},
               "ranker": {"kind": "inference", "model": str(home / "models" / "ranker.gguf")},
               "trainer": {"kind": "trainer", "model": str(home / "models" / "tiny.gguf")},
               "evaluator": {"kind": "evaluator"}}
    with Daemon(home, workers, server={"request_timeout": 30}) as d:
        d.wait(lambda st: all(w["state"] == "running" for w in st["workers"]), timeout=90, what="workers running")
        yield d


def test_a_thousand_hostile_bodies_get_no_server_error(daemon):
    rng = random.Random(SEED)
    addr = (daemon.http.removeprefix("http://").rsplit(":", 1)[0], int(daemon.http.rsplit(":", 1)[1]))
    bad, slow, counts = [], [], {}
    cases = [(m, p, raw) for m, p, _ in ROUTES for raw in RAW]
    for _ in range(COUNT):
        method, path, body = rng.choice(ROUTES)
        mutated = mutate(rng, body)
        cases.append((method, path, json.dumps(mutated).encode("utf-8", "surrogatepass")))
    restarts = {w["name"]: w["restarts"] for w in daemon.status()["workers"]}
    for method, path, raw in cases:
        t0 = time.monotonic()
        try:
            status, text = send(addr, method, path, raw)
        except (TimeoutError, OSError) as e:
            bad.append((path, raw[:300], f"no answer: {e}"))
            continue
        took = time.monotonic() - t0
        counts[status] = counts.get(status, 0) + 1
        if status >= 500:
            bad.append((path, raw[:300], status, text[:300]))
        if took > 10:
            slow.append((path, raw[:200], round(took, 1)))
    print("statuses:", dict(sorted(counts.items())), "cases:", len(cases))
    assert len(cases) >= 1000
    assert not bad, f"{len(bad)} server errors or unanswered, e.g.:\n" + "\n".join(map(str, bad[:15]))
    assert not slow, slow[:10]
    after = {w["name"]: w["restarts"] for w in daemon.status()["workers"]}
    assert after == restarts, (restarts, after)
