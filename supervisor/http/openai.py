"""OpenAI-compatible routes.

A route validates its body (supervisor/openai_validate.py: 400 naming the field) into a Work and
hands it to the pipeline (supervisor/http_pipeline.py), which routes it and answers in the shape
of supervisor/openai_shapes.py. Admission, the model's worker (400 for a model not served, 503
without Retry-After for a fatal worker), waiting through a worker's restart,
retrying a request that produced nothing and deadlines are the router's: a 503 comes only when
its queue is full or the worker did not come back within `server.wait_for_worker`. A stream
already under way when its worker dies ends with an error event and `[DONE]`; a client that
disconnects cancels its request.
"""

from __future__ import annotations

import base64
import time
import uuid

import falcon
import numpy as np

from .images import Images, fetching
from .common import JSONError, bus, real_path, served_file
from .pipeline import Pipeline, WorkerGone, refusal, stream_flag
from .llama_fields import FIELDS as LLAMA_FIELDS, llama_params
from .openai_shapes import Answer as AnswerShape
from .inputs import embedding_inputs, prompts
from .openai_validate import (CHAT_FIELDS, COMPLETION_FIELDS, EMBEDDING_FIELDS, adapter, bad, grammar, keep_alive,
                              known_fields, logprobs, messages, sampling_params, tools, truncation)
from .work import Work, model_of


class OpenAI:
    def __init__(self, sup, pipe: Pipeline):
        self.sup, self.pipe = sup, pipe

    # -- routes --

    def on_get_models(self, req, resp):
        resp.media = {"object": "list", "data": self._models()}

    def on_get_model(self, req, resp, model):
        """One model of the list (`client.models.retrieve`): a served model or a library one."""
        found = next((m for m in self._models() if m["id"] == model), None)
        if found is None:
            raise JSONError(404, "model_not_found", f"model {model!r} is neither served nor in the library "
                            f"(GET /v1/models lists them)")
        resp.media = found

    def _models(self) -> list[dict]:
        data, workers = [], bus(self.sup, "status")["workers"]
        for w in workers:
            if w["kind"] not in ("inference", "moe-stream") or w.get("group") not in (None, w["name"]):
                continue                         # a copy is listed once, as its group
            copies = sum(1 for x in workers if x.get("group") and x["group"] == w.get("group"))
            data.append({"id": w["name"], "object": "model", "created": int(time.time()), "owned_by": "kiln",
                         "meta": {"model": (w["stats"] or {}).get("model") or w["model"], "state": w["state"],
                                  "worker_state": w["worker_state"], "n_ctx": (w["stats"] or {}).get("n_ctx"),
                                  "loaded": w["pid"] is not None,          # a stopped worker holds none
                                  **({"replicas": copies} if copies else {})}})
        # the library: a request naming any of these loads it (a file a worker serves, or is
        # still loading, is listed once: as its worker)
        served = {d["id"] for d in data} | {str(d["meta"]["model"] or "").rsplit("/", 1)[-1].removesuffix(".gguf")
                                            for d in data}
        files = {f for f in map(served_file, workers) if f}
        for m in bus(self.sup, "library")["models"]:
            if m["name"] not in served and real_path(m["path"]) not in files:
                data.append({"id": m["name"], "object": "model", "created": int(m["modified"]), "owned_by": "kiln",
                             "meta": {"model": m["path"], "loaded": False, "size_bytes": m["size_bytes"]}})
        return data

    def on_post_chat(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, CHAT_FIELDS | LLAMA_FIELDS)
        images = Images(fetching(self.sup))
        work = Work(messages=messages(body, images), model=body.get("model"), **tools(body), **grammar(body),
                    **adapter(body), **keep_alive(body), **truncation(body), **images.work())
        self._generate(req, resp, body, work, chat=True)

    def on_post_completions(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, COMPLETION_FIELDS | LLAMA_FIELDS)
        works = [Work(model=body.get("model"), **w, **grammar(body), **adapter(body), **keep_alive(body))
                 for w in prompts(body)]
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise bad("echo", "echo must be a boolean", "invalid_type")
        if echo or len(works) > 1:
            if body.get("stream"):
                raise bad("stream", "stream is not supported with echo or with several prompts")
            if body.get("n", 1) != 1:
                raise bad("n", "n > 1 is not supported with echo or with several prompts")
            return self._batch(req, resp, body, works, echo)
        self._generate(req, resp, body, works[0], chat=False)

    def _generate(self, req, resp, body: dict, work: Work, chat: bool) -> None:
        work.params = {**sampling_params(body, unbounded=True), **llama_params(body)}
        lp = logprobs(body, chat)
        if lp is not None:
            work.params["logprobs"] = lp
        stream = stream_flag(body)
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise bad("stream_options", "stream_options must be an object", "invalid_type")
        shape = AnswerShape(chat, lp is not None, work.params.get("n", 1), bool(so.get("include_usage")))
        self.pipe.generate(req, resp, work, shape, stream)

    def _batch(self, req, resp, body: dict, works: list[Work], echo: bool) -> None:
        """Non-stream completions for several prompts, optionally echoing each prompt with the
        log-probabilities of its tokens (as evaluation harnesses ask). Every prompt goes to the
        worker the first one went to."""
        params = {**sampling_params(body, min_tokens=0 if echo else 1), **llama_params(body)}
        lp = logprobs(body, chat=False)
        if lp is not None:
            params["logprobs"] = lp
        n_gen = params.pop("max_tokens", 16)         # OpenAI's default for completions
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        name = None

        def where(work: Work) -> dict:
            return {"worker": name} if name else {"model": work.model} if work.model else {}
        try:
            for index, work in enumerate(works):
                pieces, lps, tops, prefix = [], [], [], ""
                given = {"text": work.text, "special": work.special} if work.text is not None else {"prompt": work.prompt}
                if echo:
                    scored, name = self.pipe.call(req, "score", {**given, "top": lp or 0, **where(work),
                                                                  **({"adapter": work.adapter} if work.adapter is not None else {}),
                                                                  **({"adapter_scale": work.adapter_scale}
                                                                     if work.adapter_scale is not None else {})},
                                                  param="prompt")
                    prefix = work.text if work.text is not None else self.pipe.call(
                        req, "detokenize", {"tokens": work.prompt, "worker": name}, param="prompt")[0]["text"]
                    pieces, lps = scored["pieces"], scored["token_logprobs"]
                    tops = [None if t is None else {p: v for _, v, p in t} for t in scored["top_logprobs"]]
                    usage["prompt_tokens"] += len(scored["tokens"])
                text, reason = "", "length"
                if n_gen > 0:
                    final = None
                    work.params = dict(params, max_tokens=n_gen)
                    answer = self.pipe.answer(req, "generate", {**work.body(), "model": None, **where(work)}, whole=True)
                    name = name or answer.worker
                    for msg in answer:
                        if msg.type == "chunk":
                            text += msg.body["text"]
                            if lp is not None:
                                pieces.append(msg.body["piece"])
                                lps.append(msg.body["logprob"])
                                tops.append({p: v for _, v, p in msg.body["top_logprobs"]})
                        else:
                            final = msg.body
                    if final is None:
                        raise JSONError(499, "client_closed", "the client closed the connection")
                    text += final["text"]
                    reason = "length" if final["finish_reason"] == "length" else "stop"
                    u = final["usage"]
                    usage["completion_tokens"] += u["completion_tokens"]
                    usage["cached_tokens"] += u["cached_tokens"]
                    if not echo:
                        usage["prompt_tokens"] += u["prompt_tokens"]
                lps_out = None
                if lp is not None:
                    offsets, pos = [], 0
                    for piece in pieces:
                        offsets.append(pos)
                        pos += len(piece)
                    lps_out = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
                choices.append({"index": index, "text": prefix + text, "logprobs": lps_out, "finish_reason": reason})
        except WorkerGone as e:
            raise refusal(e.msg, "prompt") from None
        resp.media = {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
                      "model": body.get("model") or name, "choices": choices, "system_fingerprint": "kiln",
                      "usage": {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                                "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                                "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]}}}

    def on_post_embeddings(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, EMBEDDING_FIELDS)
        work = {"inputs": embedding_inputs(body), **adapter(body), **keep_alive(body)}
        if model_of(body):
            work["model"] = model_of(body)
        if body.get("dimensions") is not None:
            work["dimensions"] = body["dimensions"]
        out, name = self.pipe.call(req, "embed", work, 600, "input")
        req.context.usage = {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": 0}
        b64 = body.get("encoding_format") == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v).decode() if b64 else np.frombuffer(v, "<f4").tolist()}
                for i, v in enumerate(out["embeddings"])]
        n = out["usage"]["prompt_tokens"]
        resp.media = {"object": "list", "data": data, "model": body.get("model") or name,
                      "usage": {"prompt_tokens": n, "total_tokens": n}}


def install(app: falcon.App, sup, pipe: Pipeline) -> None:
    api = OpenAI(sup, pipe)
    app.add_route("/v1/models", api, suffix="models")
    app.add_route("/v1/models/{model}", api, suffix="model")
    app.add_route("/v1/chat/completions", api, suffix="chat")
    app.add_route("/v1/completions", api, suffix="completions")
    app.add_route("/v1/embeddings", api, suffix="embeddings")
