"""Embedders and rerankers served by a real daemon: /v1/embeddings and Ollama's /api/embed on a
BERT embedder (dimensions, truncate), /v1/rerank and its aliases in llama-server's (Jina/Cohere)
and TEI's shapes, `kiln rerank`, /api/show's capabilities; what an encoder cannot do is a 400
naming it, and the worker keeps serving."""

import json

import numpy as np
import pytest

from conftest import DATA
from daemon_harness import Daemon, http_json, kiln
from kiln.native.encoder import load_encoder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
TINY = DATA / "tiny"
RANKS = json.loads((TINY / "tiny-bert-rerank.json").read_text())


def pooling_none(home) -> str:
    """tiny-bert with its pooling_type patched in place to 0 (none): a model that pools nothing."""
    data = bytearray((TINY / "tiny-bert.gguf").read_bytes())
    key = b"bert.pooling_type"
    at = data.index(key) + len(key) + 4                   # the u32 type, then the value
    data[at:at + 4] = (0).to_bytes(4, "little")
    (home / "tiny-bert-none.gguf").write_bytes(data)
    return str(home / "tiny-bert-none.gguf")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("retrieval")
    with Daemon(home, {"embedder": {"kind": "inference", "model": str(TINY / "tiny-bert.gguf"),
                                    "settings": {"weights": "private"}},
                       "tokens": {"kind": "inference", "model": pooling_none(home)},
                       "reranker": {"kind": "inference", "model": str(TINY / "tiny-bert-rerank.gguf")},
                       "qwen-reranker": {"kind": "inference", "model": str(TINY / "tiny-qwen3-rerank.gguf")}}) as d:
        d.wait(lambda st: all(w["worker_state"] == "ready" for w in st["workers"]), timeout=60, what="models loaded")
        yield d


@pytest.fixture(scope="module")
def local():
    return load_encoder(TINY / "tiny-bert.gguf")


def test_openai_embeddings_from_a_bert_embedder(served, local):
    texts = ["Hello world", "What is the capital of France?", "Kiln bakes clay pottery"]
    status, out = http_json(served, "POST", "/v1/embeddings", {"model": "embedder", "input": texts})
    assert status == 200, out
    got = np.array([d["embedding"] for d in out["data"]], np.float32)
    want = np.array(local.pooled([local.tokenizer.encode(t, special=False) for t in texts]))
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    assert np.allclose(got, want, atol=1e-6) and out["usage"]["prompt_tokens"] == sum(
        len(local.tokenizer.encode(t, special=False)) for t in texts)
    status, short = http_json(served, "POST", "/v1/embeddings", {"model": "embedder", "input": texts[0], "dimensions": 16})
    v = np.array(short["data"][0]["embedding"])
    assert status == 200 and len(v) == 16 and abs(np.linalg.norm(v) - 1) < 1e-5       # cut, then normalised
    assert np.allclose(v, want[0][:16] / np.linalg.norm(want[0][:16]), atol=1e-6)
    status, err = http_json(served, "POST", "/v1/embeddings", {"model": "embedder", "input": "x", "dimensions": 65})
    assert status == 400 and "64-dimensional" in err["error"]["message"]


def test_ollama_embed_cuts_a_long_input_unless_told_not_to(served, local):
    long = " ".join(["the cat sat on the mat"] * 40)          # 242 tokens; the context holds 128
    status, out = http_json(served, "POST", "/api/embed", {"model": "embedder", "input": [long, "hello"]})
    assert status == 200 and out["prompt_eval_count"] == 128 + 3, out
    ids = local.tokenizer.encode(long, special=False)
    want = local.pooled([ids[:127] + [ids[-1]]])[0]           # cut to the context, its [SEP] kept
    assert np.allclose(out["embeddings"][0], want / np.linalg.norm(want), atol=1e-6)
    status, err = http_json(served, "POST", "/api/embed", {"model": "embedder", "input": long, "truncate": False})
    assert status == 400 and "the context holds 128" in err["error"], err


def test_rerank_in_llama_servers_shape_sorted_with_top_n(served):
    pair = RANKS["pairs"][0]
    body = {"model": "reranker", "query": pair["query"], "documents": pair["documents"]}
    status, out = http_json(served, "POST", "/v1/rerank", body)
    assert status == 200, out
    order = sorted(range(len(pair["scores"])), key=lambda i: -pair["scores"][i])
    assert [r["index"] for r in out["results"]] == order
    assert all(abs(r["relevance_score"] - pair["scores"][r["index"]]) <= 1e-4 for r in out["results"])
    assert out["usage"]["prompt_tokens"] == sum(map(len, pair["ids"])) and out["object"] == "list"
    for path in ("/rerank", "/v1/reranking", "/reranking"):
        status, again = http_json(served, "POST", path, {**body, "top_n": 2, "return_documents": True})
        assert status == 200 and [r["index"] for r in again["results"]] == order[:2]
        assert again["results"][0]["document"] == {"text": pair["documents"][order[0]]}
    status, tei = http_json(served, "POST", "/rerank", {"model": "reranker", "query": pair["query"],
                                                         "texts": [{"text": d} for d in pair["documents"]],
                                                         "return_text": True})
    assert status == 200 and [(r["index"], r["text"]) for r in tei] == [(i, pair["documents"][i]) for i in order]


@pytest.mark.parametrize("body, field, words", [
    ({"documents": ["a"]}, "query", "query is required"),
    ({"query": "q", "documents": []}, "documents", "non-empty array"),
    ({"query": "q", "documents": ["a", 3]}, "documents[1]", "must be a string"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n", "out of range"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents", "true or false"),
    ({"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields", "unsupported field"),
])
def test_a_malformed_rerank_body_is_a_400_naming_the_field(served, body, field, words):
    status, out = http_json(served, "POST", "/v1/rerank", {"model": "reranker", **body})
    assert status == 400 and out["error"]["param"] == field and words in out["error"]["message"], out


def test_what_an_encoder_cannot_do_is_a_400_and_it_keeps_serving(served):
    pids = [w["pid"] for w in served.status()["workers"]]
    for model, path, body, words in (
            ("embedder", "/v1/rerank", {"query": "q", "documents": ["a"]}, "not a reranker"),
            ("reranker", "/v1/embeddings", {"input": "hello"}, "is a reranker"),
            ("embedder", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "cannot generate"),
            ("embedder", "/v1/completions", {"prompt": "hi"}, "cannot generate")):
        status, out = http_json(served, "POST", path, {"model": model, **body})
        assert status == 400 and words in json.dumps(out), (path, out)
    st = served.status()
    assert [w["pid"] for w in st["workers"]] == pids and all(w["restarts"] == 0 for w in st["workers"])


def test_a_causal_reranker_answers_the_same_route(served):
    ref = json.loads((TINY / "tiny-qwen3-rerank.json").read_text())["pairs"][0]
    status, out = http_json(served, "POST", "/v1/rerank", {"model": "qwen-reranker", "query": ref["query"],
                                                            "documents": ref["documents"], "top_n": 2})
    assert status == 200, out
    want = sorted(range(len(ref["scores"])), key=lambda i: -ref["scores"][i][0])[:2]
    assert [r["index"] for r in out["results"]] == want
    assert all(abs(r["relevance_score"] - ref["scores"][r["index"]][0]) <= 1e-6 for r in out["results"])
    status, err = http_json(served, "POST", "/v1/embeddings", {"model": "qwen-reranker", "input": "hi"})
    assert status == 400 and "is a reranker" in err["error"]["message"], err


def test_llama_servers_embedding_route_pools_normalises_or_gives_every_token(served, local):
    text = "What is the capital of France?"
    ids = local.tokenizer.encode(text, special=False)
    pooled = local.pooled([ids])[0]
    for norm, want in ((2, pooled / np.linalg.norm(pooled)), (-1, pooled),
                       (0, pooled * np.float32(1.0 / (np.abs(pooled).max() / 32760.0)))):
        status, out = http_json(served, "POST", "/embedding", {"model": "embedder", "content": text, "embd_normalize": norm})
        assert status == 200 and [e["index"] for e in out] == [0] and len(out[0]["embedding"]) == 1, out
        assert np.allclose(out[0]["embedding"][0], want, rtol=1e-6, atol=1e-6), norm
    status, out = http_json(served, "POST", "/embeddings", {"model": "tokens", "content": [text, "Hello world"]})
    assert status == 200 and len(out) == 2, out
    assert np.allclose(out[0]["embedding"], local.pooled([ids], "none")[0], atol=1e-6)   # per token, not normalised
    assert len(out[1]["embedding"]) == len(local.tokenizer.encode("Hello world", special=False))
    for path, body, field in (("/v1/embeddings", {"model": "tokens", "input": text}, "pools nothing"),
                              ("/embedding", {"model": "embedder", "content": text, "embd_normalize": 1}, "embd_normalize"),
                              ("/embedding", {"model": "embedder", "content": text, "encoding_format": "base64"},
                               "encoding_format")):
        status, err = http_json(served, "POST", path, body)
        assert status == 400 and field in json.dumps(err), (path, err)


def test_hostile_bodies_on_the_bus_are_refused_by_the_worker(served):
    """The HTTP routes validate their bodies; a bus client (the CLI, a script) reaches the worker's
    ops directly: wrong element types are a bad_request naming them, never a crash."""
    from kiln.protocol.client import CommandFailed
    from kiln.supervisor.bus.client import ControlClient
    with ControlClient(served.paths) as c:
        for op, body, words in (("rerank", {"model": "reranker", "query": "q", "documents": ["a", 5]}, "documents[1]"),
                                ("rerank", {"model": "reranker", "query": "q", "documents": []}, "1 to 1,024"),
                                ("embed", {"model": "embedder", "inputs": [5]}, "input[0]"),
                                ("embed", {"model": "embedder", "inputs": [["x"]]}, "input[0]")):
            with pytest.raises(CommandFailed) as e:
                list(c.stream(op, {**body, "timeout": 30}, timeout=30))
            assert e.value.code == "bad_request" and words in e.value.message, (op, body, e.value.message)
    assert all(w["restarts"] == 0 for w in served.status()["workers"])


def test_capabilities_in_api_show_and_kiln_rerank(served):
    for model, caps in (("embedder", ["embedding"]), ("reranker", ["rerank"])):
        status, out = http_json(served, "POST", "/api/show", {"model": model})
        assert status == 200 and out["capabilities"] == caps, out
    pair = RANKS["pairs"][1]
    r = kiln(served.home, "rerank", pair["query"], *pair["documents"], "--model", "reranker", "--json")
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -pair["scores"][i])


def test_an_encoder_worker_honours_private_weights_and_counts_its_requests(served):
    """weights = "private" copies an encoder's tensors out of the page cache as it does a chat
    model's (the embeddings above are computed from that copy); embed and rerank are requests."""
    st = served.worker("embedder")["stats"]
    assert st["weights"]["mode"] == "private", st["weights"]
    before = st["requests"]
    ranked = served.worker("reranker")["stats"]["requests"]
    assert http_json(served, "POST", "/v1/embeddings", {"model": "embedder", "input": ["a", "b"]})[0] == 200
    assert http_json(served, "POST", "/v1/rerank", {"model": "reranker", "query": "q", "documents": ["x"]})[0] == 200

    def counted(st):                  # the stats come with the workers' heartbeats (`before` may lag too)
        stats = {w["name"]: w["stats"] for w in st["workers"]}
        return stats["embedder"]["requests"] >= before + 1 and stats["reranker"]["requests"] >= ranked + 1
    served.wait(counted, timeout=15, what="the requests counted")
