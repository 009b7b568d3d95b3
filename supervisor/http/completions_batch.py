"""`POST /v1/completions/batch`: many prompts, each sampled `n` times, in one request — how a
GRPO dataset's groups are made (every candidate of a group from the same prompt, each its own
sampling stream of one seed).

    {"model": "…", "prompts": ["…", [1, 2, 3], …], "n": 4, "max_tokens": 64, "temperature": 0.8,
     "seed": 7, "logprobs": 0}

answers `{"object": "text_completion.batch", "results": [{"index": i, "choices": [{"index": j,
"text", "finish_reason", "logprobs"}], "usage"}], "usage"}` in the prompts' order. The prompts run
at once, as many as the worker's `parallel` holds, each prefilled once for its n samples (the
engine's n). A prompt that fails fails the request, naming it (`prompts[i]`), and the others are
stopped. Sampling fields are /v1/completions'; `max_tokens` defaults to 16 as there."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from .common import JSONError
from .llama_fields import FIELDS as LLAMA_FIELDS, llama_params
from .inputs import prompts
from .openai_validate import COMPLETION_FIELDS, adapter, bad, keep_alive, known_fields, logprobs, sampling_params
from .pipeline import Pipeline, WorkerGone, refusal
from .work import Work

MAX_PROMPTS = 256
FIELDS = (COMPLETION_FIELDS - {"prompt", "echo", "suffix", "stream", "stream_options"}) | {"prompts"} | LLAMA_FIELDS
RUN_AT_ONCE = 8          # requests in flight from one batch (the worker queues the rest anyway)
_LOCK = threading.Lock()


class CompletionsBatch:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, FIELDS)
        given = body.get("prompts")
        if not isinstance(given, list) or not 1 <= len(given) <= MAX_PROMPTS:
            raise bad("prompts", f"prompts must be a list of 1 to {MAX_PROMPTS} prompts (strings or token-id lists)",
                      "invalid_type")
        items = []
        for i, p in enumerate(given):
            try:
                items += prompts({"prompt": p})
            except JSONError as e:
                raise bad(f"prompts[{i}]", e.kiln_body["error"]["message"].replace("prompt", f"prompts[{i}]", 1)) from None
            if len(items) != i + 1:
                raise bad(f"prompts[{i}]", f"prompts[{i}] must be one prompt: a string or a list of token ids")
        params = {"max_tokens": 16, **sampling_params(body), **llama_params(body)}
        n = params.get("n", 1)
        lp = logprobs(body, chat=False)
        if lp is not None:
            params["logprobs"] = lp
        works = [Work(model=body.get("model"), **w, params=params, **adapter(body), **keep_alive(body)) for w in items]
        failed, first_error = threading.Event(), []
        with ThreadPoolExecutor(max_workers=min(RUN_AT_ONCE, len(works))) as pool:
            futures = [pool.submit(self._one, req, i, w, n, lp is not None, failed, first_error)
                       for i, w in enumerate(works)]
            done = [f.exception() or f.result() for f in futures]
        if first_error:                   # the failure that stopped the others, not their stopping
            raise first_error[0]
        results = done
        usage = {k: sum(r["usage"][k] for r in results) for k in ("prompt_tokens", "completion_tokens")}
        resp.media = {"id": "cmplb-" + uuid.uuid4().hex[:24], "object": "text_completion.batch",
                      "created": int(time.time()), "model": body.get("model") or results[0].pop("worker"),
                      "results": [{k: v for k, v in r.items() if k != "worker"} for r in results],
                      "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}}

    def _one(self, req, i: int, work: Work, n: int, with_lp: bool, failed: threading.Event,
             first_error: list) -> dict:
        """One prompt's n samples: {"index", "choices", "usage", "worker"}; the first failure of
        the batch is kept in first_error and stops the others."""
        try:
            return self._run(req, i, work, n, with_lp, failed)
        except Exception as e:
            with _LOCK:
                if not failed.is_set():   # later errors are the others being stopped by this one
                    first_error.append(e)
                    failed.set()
            raise

    def _run(self, req, i: int, work: Work, n: int, with_lp: bool, failed: threading.Event) -> dict:
        where = f"prompts[{i}]"
        try:
            if failed.is_set():
                raise JSONError(499, "cancelled", f"{where} was not run: another prompt of the batch failed")
            answer = self.pipe.answer(req, "generate", work.body(), whole=True, stop=failed.is_set)
            texts, lps, final = [""] * n, [[] for _ in range(n)], None
            for msg in answer:
                if msg.type == "chunk":
                    j = msg.body.get("index", 0)
                    texts[j] += msg.body["text"]
                    if with_lp:
                        lps[j].append((msg.body["piece"], msg.body["logprob"],
                                       {p: v for _, v, p in msg.body["top_logprobs"]}))
                else:
                    final = msg.body
            if final is None:
                raise JSONError(499, "client_closed", "the client closed the connection")
        except WorkerGone as e:
            raise refusal(e.msg, where) from None
        except JSONError as e:
            if e.kiln_body.get("error", {}).get("param") in ("prompt", "messages"):
                e.kiln_body["error"]["param"] = where
            raise
        finals = final["choices"] if n > 1 else [final]
        choices = []
        for f in finals:
            j = f.get("index", 0)
            choices.append({"index": j, "text": texts[j] + f["text"],
                            "finish_reason": "length" if f["finish_reason"] == "length" else "stop",
                            "logprobs": _logprobs(lps[j]) if with_lp else None})
        u = final["usage"]
        return {"index": i, "choices": sorted(choices, key=lambda c: c["index"]), "worker": answer.worker,
                "usage": {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                          "cached_tokens": u["cached_tokens"]}}


def _logprobs(toks: list[tuple]) -> dict:
    offsets, pos = [], 0
    for piece, _, _ in toks:
        offsets.append(pos)
        pos += len(piece)
    return {"tokens": [t[0] for t in toks], "token_logprobs": [t[1] for t in toks],
            "top_logprobs": [t[2] for t in toks], "text_offset": offsets}


def install(app, pipe: Pipeline) -> None:
    app.add_route("/v1/completions/batch", CompletionsBatch(pipe))
