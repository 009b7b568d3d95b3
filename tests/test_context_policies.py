"""Context policies through a real daemon (a worker of 512 tokens of context): a conversation of
about twice the context is refused by default, and with truncation "auto" (chat completions and
the Responses API) or Ollama's truncate the oldest turns go — the answer says how many, and it is
the answer to the kept conversation sent as it is. The worker keeps its KV cache in q8_0 (a
long conversation on a laptop: half the memory), which its status, `kiln ps` and Ollama's
/api/ps count at its real size."""

import json
import urllib.request

import pytest

from daemon_harness import Daemon, http_json, kiln

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
CTX = 512
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    workers = {"default": {"kind": "inference", "model": str(default_model_path), "settings": {"ctx": CTX, "kv_type": "q8_0"}}}
    home = tmp_path_factory.mktemp("context")
    workers["default"]["settings"]["slot_save_path"] = str(home / "slots")
    with Daemon(home, workers) as d:
        d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=90, what="model loaded")
        yield d


def conversation(turns: int = 14) -> list[dict]:
    out = [SYSTEM]
    for i in range(turns):
        out.append({"role": "user", "content": f"Fact number {i}: the {i}th colour in my list is colour {i * 7}. "
                                               f"Please remember it along with the others."})
        out.append({"role": "assistant", "content": f"Noted: colour {i * 7} is number {i}. I will remember it."})
    out.append({"role": "user", "content": "Which colour was the last one?"})
    return out


def chat(d, body: dict) -> tuple[int, dict]:
    return http_json(d, "POST", "/v1/chat/completions", {"model": "default", "temperature": 0, "max_tokens": 16, **body})


def test_chat_truncation_drops_the_oldest_turns_and_says_how_many(served):
    msgs = conversation()
    status, err = chat(served, {"messages": msgs})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err     # the default
    status, out = chat(served, {"messages": msgs, "truncation": "auto"})
    assert status == 200, out
    dropped = out["truncated_messages"]
    assert dropped >= 2 and dropped % 2 == 0 and out["usage"]["prompt_tokens"] + 16 <= CTX, out
    # the answer is the kept conversation's: the system message and the latest turns
    kept = [SYSTEM] + msgs[1 + dropped:]
    status, same = chat(served, {"messages": kept})
    assert status == 200 and "truncated_messages" not in same
    assert same["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]
    assert same["usage"]["prompt_tokens"] == out["usage"]["prompt_tokens"]
    # streamed: the last chunk says it
    req = urllib.request.Request(served.http + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "default", "temperature": 0, "max_tokens": 16, "stream": True,
                                                  "messages": msgs, "truncation": "auto"}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(x[6:]) for x in r.read().decode().splitlines()
                  if x.startswith("data: ") and x != "data: [DONE]"]
    assert [e.get("truncated_messages") for e in events if e.get("truncated_messages")] == [dropped]
    status, err = chat(served, {"messages": msgs, "truncation": "middle"})
    assert status == 400 and err["error"]["param"] == "truncation"


def test_responses_truncation_auto_answers_as_the_chat_route(served):
    msgs = conversation()
    items = [{"role": m["role"], "content": m["content"]} for m in msgs[1:]]
    body = {"model": "default", "instructions": SYSTEM["content"], "input": items, "temperature": 0,
            "max_output_tokens": 16}
    status, err = http_json(served, "POST", "/v1/responses", body)
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    status, out = http_json(served, "POST", "/v1/responses", {**body, "truncation": "auto"})
    assert status == 200 and out["truncation"] == "auto", out
    _, ref = chat(served, {"messages": msgs, "truncation": "auto"})
    assert out["truncated_messages"] == ref["truncated_messages"]
    assert out["output"][0]["content"][0]["text"] == ref["choices"][0]["message"]["content"]


def test_ollama_truncate_drops_the_oldest_turns(served):
    msgs = conversation()
    body = {"model": "default", "messages": msgs, "stream": False, "options": {"temperature": 0, "num_predict": 16}}
    status, err = http_json(served, "POST", "/api/chat", body)
    assert status == 400 and "context" in err["error"], err
    status, out = http_json(served, "POST", "/api/chat", {**body, "truncate": True})
    assert status == 200 and out["done"], out
    _, ref = chat(served, {"messages": msgs, "truncation": "auto"})
    assert out["truncated_messages"] == ref["truncated_messages"]
    assert out["message"]["content"] == ref["choices"][0]["message"]["content"]
    for field, value in (("shift", 1), ("truncate", "yes")):
        status, err = http_json(served, "POST", "/api/chat", {**body, field: value})
        assert status == 400 and field in err["error"], err


def test_an_answer_longer_than_the_context_shifts_when_asked(served):
    """Past the context's end: refused by default; with context_shift (chat), shift (Ollama) or
    llama-server's n_keep/n_discard the context shifts and the answer says how often."""
    # a 475-token prompt: 60 tokens of answer go past the 512-token context (once)
    msgs = [{"role": "user", "content": "Repeat after me: " + "one two three four five six seven eight nine ten " * 44}]
    long = {"messages": msgs, "max_tokens": 60, "ignore_eos": True}
    status, err = chat(served, long)
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    status, out = chat(served, {**long, "context_shift": True})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    assert out["usage"]["completion_tokens"] == 60 and out["context_shifts"] == 1, out
    status, err = chat(served, {**long, "context_shift": "yes"})
    assert status == 400 and err["error"]["param"] == "context_shift", err
    for field, value in (("n_keep", -2), ("n_discard", -1), ("n_keep", "all"), ("n_discard", 1 << 40)):
        status, err = http_json(served, "POST", "/completion", {"prompt": "x", "n_predict": 2, "context_shift": True,
                                                                field: value})
        assert status == 400 and err["error"]["param"] == field, (field, value, err)
    status, err = chat(served, {**long, "context_shift": True, "n_keep": 4})      # llama-server's field only
    assert status == 400 and err["error"]["param"] == "n_keep", err
    status, out = http_json(served, "POST", "/completion", {
        "prompt": "One, two, three, " + "four five six seven eight nine ten " * 66, "n_predict": 60,
        "ignore_eos": True, "temperature": 0, "context_shift": True, "n_keep": 4, "n_discard": 100})
    assert status == 200 and out["truncated"] is True and out["tokens_predicted"] == 60, out
    assert out["tokens_evaluated"] + 60 > CTX, out                  # it did go past the context's end
    status, out = http_json(served, "POST", "/api/generate", {
        "model": "default", "prompt": "One, two, three,", "stream": False, "shift": True,
        "options": {"temperature": 0, "num_predict": 8, "num_keep": 4}})
    assert status == 200 and out["done_reason"] == "length" and "context_shifts" not in out, out
    status, err = http_json(served, "POST", "/api/generate", {
        "model": "default", "prompt": "x", "stream": False, "options": {"num_keep": "all"}})
    assert status == 400 and "num_keep" in err["error"], err


def test_the_q8_0_cache_is_what_the_worker_runs_and_what_ps_counts(served):
    from kiln.native.models.inspect import inspect_model
    status, _ = chat(served, {"messages": conversation(2)})
    assert status == 200
    st = served.wait(lambda s: next((w["stats"] for w in s["workers"] if w["name"] == "default" and
                                     w["stats"].get("kv_cache_tokens")), None), timeout=30, what="the cache in a heartbeat")
    assert st["kv_types"] == ["q8_0", "q8_0"]
    per_token = inspect_model(st["path"])["memory"]["kv_cache_bytes_per_token_by_type"]
    assert per_token["q8_0"] * 64 == per_token["f16"] * 34
    # the caches grow in chunks of 256 positions: every byte held is a q8_0 position's
    assert st["kv_cache_bytes"] > 0 and st["kv_cache_bytes"] % (per_token["q8_0"] * 256) == 0, st
    m = next(m for m in served.command("ps")["models"] if m["worker"] == "default")
    assert m["kv_types"] == ["q8_0", "q8_0"] and m["kv_cache_bytes"] == st["kv_cache_bytes"]
    shown = kiln(served.home, "ps")
    assert shown.returncode == 0 and "q8_0" in shown.stdout.strip().splitlines()[-1], shown.stdout + shown.stderr


def _prefix(d) -> dict:
    w = next(w for w in d.status()["workers"] if w["name"] == "default")
    return {**(w["stats"].get("prefix_cache") or {}), "pid": w.get("pid"), "state": w.get("worker_state")}


def test_a_prompt_comes_back_from_the_disk_cache_after_its_worker_is_killed(served):
    """The prompt's whole blocks are written under KILN_HOME/cache/prefix; the worker killed and
    restarted, the same request reuses them (cached_tokens) and answers the same."""
    served.wait(lambda s: _prefix(served).get("disk"), timeout=60, what="the model identified for the disk cache")
    system = {"role": "system", "content": " ".join(f"Rule {i}: answer in one short sentence." for i in range(36))}
    body = {"messages": [system, {"role": "user", "content": "What is rule 3?"}]}
    status, first = chat(served, body)
    assert status == 200, first
    blocks = first["usage"]["prompt_tokens"] // 64
    assert blocks >= 4
    before = served.wait(lambda s: (p := _prefix(served))["written"] >= blocks and p, timeout=60,
                         what="the prompt's blocks on disk")
    import os
    import signal
    os.kill(before["pid"], signal.SIGKILL)
    served.wait(lambda s: (p := _prefix(served))["pid"] != before["pid"] and p["state"] == "ready" and p.get("disk"),
                timeout=90, what="the worker restarted")
    status, again = chat(served, body)
    assert status == 200, again
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 64 - (64 if first["usage"]["prompt_tokens"] % 64 == 0 else 0)
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    # The worker's counters reach the supervisor with its next stats poll, not with the answer.
    served.wait(lambda s: _prefix(served).get("hits_disk", 0) >= blocks - 1, timeout=30,
                what="the disk hits counted in the worker's stats")


def test_llama_server_slots_save_restore_and_erase(served):
    """GET /slots lists the worker's sequences; a slot's cache saved to a file of slot_save_path,
    erased, and restored holds the same positions; names with folders, unknown actions, missing
    and foreign files are refused with what is wrong."""
    status, out = http_json(served, "POST", "/completion", {"prompt": "Slot test. " * 30, "n_predict": 1,
                                                            "temperature": 0})
    assert status == 200, out
    status, slots = http_json(served, "GET", "/slots")
    assert status == 200 and len(slots) == 4 and all(s["n_ctx"] == CTX for s in slots), slots
    i = max(slots, key=lambda s: s["tokens_cached"])["id"]
    held = slots[i]["tokens_cached"]
    assert held >= out["tokens_evaluated"]
    status, saved = http_json(served, "POST", f"/slots/{i}?action=save", {"filename": "conv.bin"})
    assert status == 200 and saved["n_saved"] == held and saved["n_written"] > 0, saved
    status, erased = http_json(served, "POST", f"/slots/{i}?action=erase")
    assert status == 200 and erased["n_erased"] == held, erased
    assert http_json(served, "GET", "/slots")[1][i]["tokens_cached"] == 0
    status, restored = http_json(served, "POST", f"/slots/{i}?action=restore", {"filename": "conv.bin"})
    assert status == 200 and restored["n_restored"] == held, restored
    assert http_json(served, "GET", "/slots")[1][i]["tokens_cached"] == held
    (served.home / "slots" / "junk.bin").write_bytes(b"KILNKVB\0" + b"\xff" * 40)
    for path, body, code, word in ((f"/slots/{i}?action=restore", {"filename": "junk.bin"}, 400, "junk.bin"),
                                   (f"/slots/{i}?action=restore", {"filename": "none.bin"}, 404, "none.bin"),
                                   (f"/slots/{i}?action=save", {"filename": "../up.bin"}, 400, "plain file name"),
                                   (f"/slots/{i}?action=dump", {"filename": "a.bin"}, 400, "action"),
                                   ("/slots/99?action=erase", None, 400, "slot id")):
        status, err = http_json(served, "POST", path, body)
        assert status == code and word in err["error"]["message"], (path, err)
