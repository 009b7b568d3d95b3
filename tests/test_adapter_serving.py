"""Adapters as served, through a real daemon: a request's `adapter_scale` (0: the base model's
answer, 1: the adapter's, between: neither), llama-server's `lora: [{id, scale}]` and
`/lora-adapters`, and requests with different adapters at once — decoded in one batch — each
answered as it is alone."""

import threading

import numpy as np
import pytest

from daemon_harness import Daemon, http_json

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ASK = {"model": "default", "messages": [{"role": "user", "content": "Where is the treasure buried?"}],
       "temperature": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def served(default_model, default_model_path, tmp_path_factory):
    from kiln.native.lora import LoraConfig, init_adapter, save_adapter
    home = tmp_path_factory.mktemp("adapters")
    (home / "adapters").mkdir()
    for name, seed in (("alpha", 7), ("beta", 8)):
        rng = np.random.default_rng(seed)
        ad = init_adapter(default_model, LoraConfig(), rng)
        for _, b in ad.tensors.values():
            b[...] = rng.normal(0, 0.5, size=b.shape).astype(np.float32)      # strong enough to change answers
        save_adapter(ad, home / "adapters" / f"{name}.gguf", name)
    with Daemon(home, {"default": {"kind": "inference", "model": str(default_model_path),
                                   "settings": {"parallel": 4}}}) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=60, what="model loaded")
        yield d


def chat(served, **extra) -> str:
    status, out = http_json(served, "POST", "/v1/chat/completions", {**ASK, **extra})
    assert status == 200, out
    return out["choices"][0]["message"]["content"]


def test_adapter_scale_goes_from_the_base_to_the_adapter(served):
    base, full = chat(served), chat(served, adapter="alpha")
    assert base != full
    assert chat(served, adapter="alpha", adapter_scale=0) == base
    assert chat(served, adapter="alpha", adapter_scale=1) == full
    half = chat(served, adapter="alpha", adapter_scale=0.5)
    assert half not in (base, full)
    assert chat(served, adapter="alpha", adapter_scale=0.5) == half           # the scaled view is reused
    for extra, words in (({"adapter_scale": 0.5}, "name one in `adapter`"),
                         ({"adapter": "alpha", "adapter_scale": 99}, "out of range"),
                         ({"adapter": "alpha", "adapter_scale": "1"}, "must be a number")):
        status, out = http_json(served, "POST", "/v1/chat/completions", {**ASK, **extra})
        assert status == 400 and words in out["error"]["message"], (extra, out)


def test_llama_servers_lora_field_and_routes(served):
    status, listed = http_json(served, "GET", "/lora-adapters")
    assert status == 200 and [(e["id"], e["name"], e["scale"]) for e in listed] == [(0, "alpha", 0.0), (1, "beta", 0.0)]
    prompt = {"prompt": "Once upon a time", "temperature": 0, "n_predict": 12}

    def completion(**extra):
        status, out = http_json(served, "POST", "/completion", {**prompt, **extra})
        assert status == 200, out
        return out["content"]
    via_lora = completion(lora=[{"id": 1, "scale": 0.5}, {"id": 0, "scale": 0}])
    assert via_lora == completion(adapter="beta", adapter_scale=0.5) != completion()
    assert completion(lora=[{"id": 0, "scale": 0}, {"id": 1, "scale": 0}]) == completion()
    status, out = http_json(served, "POST", "/completion", {**prompt, "lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 1}]})
    assert status == 400 and "one adapter per request" in out["error"]["message"]
    status, out = http_json(served, "POST", "/completion", {**prompt, "lora": [{"id": 5, "scale": 1}]})
    assert status == 400 and "no adapter with id 5" in out["error"]["message"]
    for body, words in (({"id": 0}, "JSON array"), ([{"id": "x", "scale": 1}], "id must be"),
                        ([{"id": 0, "scale": 1, "path": "/etc/passwd"}], "unsupported field"),
                        ([{"id": 9, "scale": 1}], "no adapter with")):
        status, out = http_json(served, "POST", "/lora-adapters", body)
        assert status == 400 and words in out["error"]["message"], (body, out)
    status, out = http_json(served, "POST", "/completion", {**prompt, "lora": [{"id": 0, "scale": float("inf")}]})
    assert status == 400, out
    # the global scales are which adapter is active: requests that name none get it
    status, listed = http_json(served, "POST", "/lora-adapters", [{"id": 1, "scale": 1}])
    assert status == 200 and [e["scale"] for e in listed] == [0.0, 1.0]
    try:
        assert completion() == completion(adapter="beta")
        status, out = http_json(served, "POST", "/lora-adapters", [{"id": 1, "scale": 0.3}])
        assert status == 400 and "with each request" in out["error"]["message"]
    finally:
        http_json(served, "POST", "/lora-adapters", [{"id": 1, "scale": 0}])


def test_requests_with_different_adapters_at_once_get_their_own_answers(served):
    kinds = [{}, {"adapter": "alpha"}, {"adapter": "beta"}, {"adapter": "alpha", "adapter_scale": 0.5}]
    alone = [chat(served, **k) for k in kinds]
    assert len(set(alone)) == len(alone)
    together: list = [None] * len(kinds)

    def one(i):
        together[i] = chat(served, **kinds[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(kinds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
