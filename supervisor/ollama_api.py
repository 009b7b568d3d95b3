"""Ollama's API on Kiln's port: /api/version, ps, chat, generate, embed, embeddings (the legacy
one) here; tags, show, pull, delete, copy in supervisor/ollama_library.py.

Each route translates an Ollama body into the work the OpenAI routes send (the same validation,
the same router op) and the answer back into Ollama's shapes: NDJSON streaming by default
(`"stream": false` for one object), durations in nanoseconds, errors as {"error": "..."}.
Options Kiln has no use for are refused by name, except the hardware-placement ones Kiln decides
itself (HARDWARE_OPTIONS), which change where Ollama computes, never what.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import falcon

from . import ollama_library
from .http_common import JSONError, bus, routed
from .llama_fields import llama_params
from .ollama_library import details, file_digest, file_of, ndjson, ollama_name
from .openai_api import WorkerGone, _Stream
from .openai_validate import bad, messages as check_messages, sampling_params, tools as check_tools

VERSION = "0.12.0"             # the Ollama API version these routes follow
# Ollama option -> Kiln sampling field
_OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "typical_p": "typical_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repeat_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "num_predict": "max_tokens"}
HARDWARE_OPTIONS = {"num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "num_batch", "low_vram",
                    "numa", "f16_kv", "vocab_only"}
_EMPTY_OK = {"images", "context", "suffix", "template"}
# llama.cpp's own options, as Ollama passes them on (supervisor/llama_fields.py checks them)
_LLAMA_OPTIONS = ("repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta")
_CHAT_FIELDS = {"model", "messages", "stream", "format", "options", "tools", "think", "keep_alive"}
_GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "stream", "format", "options", "think", "keep_alive", "raw"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Ollama:
    def __init__(self, sup, api):
        self.sup, self.api = sup, api            # api: the OpenAI routes (routing, answers)

    # -- helpers -------------------------------------------------------------------------------

    def _body(self, req, allowed: set[str]) -> dict:
        body = self.api.read_json(req)
        # an empty images/context/suffix/template says nothing (clients send them so): not refused
        body = {k: v for k, v in body.items() if not (k in _EMPTY_OK and v in ([], "", None))}
        for k in body:
            if k not in allowed:
                raise bad(k, f"unsupported field {k!r} for {req.path} (supported: {', '.join(sorted(allowed))})",
                          "unsupported_field")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise bad("model", "model is required (a library model name, e.g. SmolLM2-135M-Instruct.Q4_1)")
        return body

    @staticmethod
    def _options(body: dict) -> dict:
        opts = body.get("options") or {}
        if not isinstance(opts, dict):
            raise bad("options", "options must be an object", "invalid_type")
        out = {}
        for k, v in opts.items():
            if k in HARDWARE_OPTIONS:
                continue
            if k == "num_ctx":
                continue                          # checked against the worker's context below
            if k in _LLAMA_OPTIONS:
                continue                          # below
            if k not in _OPTIONS:
                raise bad(f"options.{k}", f"option {k!r} is not supported (supported: "
                          f"{', '.join(sorted(set(_OPTIONS) | {'num_ctx', 'repeat_last_n', 'mirostat'}))})")
            if k == "num_predict" and isinstance(v, int) and v < 0:
                continue                          # -1: until the context ends (Kiln's default)
            out[_OPTIONS[k]] = v
        p = sampling_params(out)
        # repeat_last_n, and mirostat only at 0 (off)
        p.update(llama_params({k: opts[k] for k in _LLAMA_OPTIONS if k in opts}))
        return p

    def _check_ctx(self, body: dict, route: dict) -> None:
        want = (body.get("options") or {}).get("num_ctx")
        if want is None:
            return
        have = route.get("n_ctx")
        if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
            raise bad("options.num_ctx", "num_ctx must be a positive integer")
        if have and want > have:
            raise bad("options.num_ctx", f"num_ctx = {want}, but {route['worker']} runs with a {have}-token context; "
                      f"set [models] ctx (or the worker's settings.ctx) and reload it")

    @staticmethod
    def _format(body: dict) -> dict:
        fmt = body.get("format")
        if fmt in (None, ""):
            return {}
        if fmt == "json":
            return {"response_format": {"type": "json_object"}}
        if isinstance(fmt, dict):
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
        raise bad("format", 'format must be "json" or a JSON schema object')

    @staticmethod
    def _think(body: dict) -> dict:
        think = body.get("think")
        if think is None:
            return {}
        if isinstance(think, str) and think in ("low", "medium", "high"):
            return {"reasoning_effort": think}
        if not isinstance(think, bool):
            raise bad("think", 'think must be true, false, or "low" / "medium" / "high"')
        return {"chat_template_kwargs": {"enable_thinking": think}}

    def _route(self, req, body: dict) -> dict:
        try:
            return self.api.route(body, req)
        except JSONError as e:
            if e.kiln_body["error"].get("code") == "model_not_found":
                raise JSONError(404, "model_not_found", e.kiln_body["error"]["message"]) from None
            raise

    def _run(self, req, resp, body: dict, work: dict, kind: str) -> None:
        """Generate and answer in Ollama's shape: NDJSON chunks, or one object."""
        params = self._options(body)              # first: it checks that options is an object
        route = self._route(req, body)
        self._check_ctx(body, route)
        params.setdefault("max_tokens", -1)
        work = dict(work, params=params, worker=route["worker"])
        if body.get("keep_alive") is not None:
            from .openai_validate import keep_alive
            work.update(keep_alive(body))
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise bad("stream", "stream must be a boolean", "invalid_type")
        t0 = time.perf_counter()
        answer = self.api.answer(req, "generate", work, whole=not stream)
        model = body["model"]
        field = "message" if kind == "chat" else "response"

        def part(text="", reasoning="", calls=()):
            if kind == "chat":
                msg = {"role": "assistant", "content": text}
                if reasoning:
                    msg["thinking"] = reasoning
                if calls:
                    msg["tool_calls"] = [{"function": {"name": c["name"], "arguments": _args(c["arguments"])}}
                                         for c in calls]
                return {field: msg}
            out = {field: text}
            if reasoning:
                out["thinking"] = reasoning
            return out

        def closing(final: dict) -> dict:
            u, tm = final["usage"], final.get("timings") or {}
            reason = final["finish_reason"]
            return {"model": model, "created_at": _now(), **part(), "done": True,
                    "done_reason": "length" if reason == "length" else "stop",
                    "total_duration": _ns(time.perf_counter() - t0), "load_duration": 0,
                    "prompt_eval_count": u["prompt_tokens"] - u.get("cached_tokens", 0),
                    "prompt_eval_duration": _ns(tm.get("prefill_s", 0)),
                    "eval_count": u["completion_tokens"], "eval_duration": _ns(tm.get("decode_s", 0))}

        if stream:
            def lines():
                try:
                    for msg in answer:
                        if msg.type == "chunk":
                            b = msg.body
                            if b.get("text") or b.get("reasoning") or b.get("tool_calls"):
                                yield ndjson({"model": model, "created_at": _now(), **part(
                                    b.get("text", ""), b.get("reasoning", ""), b.get("tool_calls", ())), "done": False})
                        else:
                            f = msg.body
                            if f.get("text") or f.get("reasoning") or f.get("tool_calls"):
                                yield ndjson({"model": model, "created_at": _now(), **part(
                                    f.get("text", ""), f.get("reasoning", ""), f.get("tool_calls", ())), "done": False})
                            yield ndjson(closing(f))
                except WorkerGone as e:
                    from .http_common import error_from
                    yield ndjson({"error": error_from(e.msg).kiln_body["error"]["message"]})
            resp.content_type = "application/x-ndjson"
            resp.stream = _Stream(lines(), answer)
            return
        text, reasoning, calls, final = [], [], [], None
        try:
            for msg in answer:
                b = msg.body
                text.append(b.get("text", ""))
                reasoning.append(b.get("reasoning", ""))
                calls += b.get("tool_calls", [])
                if msg.type != "chunk":
                    final = b
        except WorkerGone as e:
            from .http_common import error_from
            raise error_from(e.msg) from None
        finally:
            answer.close()
        if final is None:
            raise JSONError(499, "client_closed", "the client closed the connection")
        out = closing(final)
        out.update(part("".join(text), "".join(reasoning), calls))
        resp.media = out

    # -- routes --------------------------------------------------------------------------------

    def on_get_version(self, req, resp):
        resp.media = {"version": VERSION}

    def on_get_ps(self, req, resp):
        out = []
        for m in bus(self.sup, "ps")["models"]:
            exp = m.get("expires_at")
            path = file_of(m.get("path") or str(m["model"]))
            st = path.stat() if path else None
            out.append({"name": ollama_name(str(m["model"])), "model": ollama_name(str(m["model"])),
                        # Ollama's size is the memory the model is given (weights and its whole KV
                        # cache, allocated up front): Kiln's plan of it, not the RSS of mapped pages
                        # touched so far (which starts at a few hundred KB)
                        "size": m.get("planned_bytes") or m.get("rss_bytes") or 0, "size_vram": 0,
                        "digest": file_digest(str(path), st.st_size, st.st_mtime) if st else "",
                        "details": details(str(path) if path else ""),
                        "expires_at": datetime.fromtimestamp(exp, timezone.utc).isoformat() if exp else
                        "9999-12-31T23:59:59Z", "context_length": m.get("n_ctx") or 0})
        resp.media = {"models": out}

    def on_post_chat(self, req, resp):
        body = self._body(req, _CHAT_FIELDS)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", "messages must be a non-empty list")
        conv = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}]", "each message must be an object", "invalid_type")
            if m.get("images"):
                raise bad(f"messages[{i}].images", "Kiln serves text models: images are not supported")
            m = {k: v for k, v in m.items() if k not in ("images", "thinking")}
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": f"call_{j}", "type": "function", "function": {
                    "name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments", {})}}
                    for j, c in enumerate(m["tool_calls"])]
            if "tool_name" in m:
                m["name"] = m.pop("tool_name")
            conv.append(m)
        oa = {"messages": conv, "tools": body.get("tools"), **self._format(body), **self._think(body)}
        work = {"messages": check_messages(oa), **check_tools({k: v for k, v in oa.items() if v is not None})}
        self._run(req, resp, body, work, "chat")

    def on_post_generate(self, req, resp):
        body = self._body(req, _GENERATE_FIELDS)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "prompt must be a string", "invalid_type")
        if body.get("suffix") is not None:        # fill in the middle: prompt is the code before the gap
            return self._run(req, resp, body, {"infill": self._infill(body)}, "generate")
        if not prompt:                            # Ollama: an empty prompt loads the model
            route = self._route(req, body)
            resp.media = {"model": body["model"], "created_at": _now(), "response": "", "done": True,
                          "done_reason": "load", "worker": route["worker"]}
            return
        if body.get("raw"):
            if body.get("system"):
                raise bad("system", "system cannot be combined with raw")
            work = {"text": prompt, "special": True}
        else:
            msgs = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + \
                [{"role": "user", "content": prompt}]
            oa = {"messages": msgs, **self._format(body), **self._think(body)}
            work = {"messages": check_messages(oa), **check_tools(oa)}
        self._run(req, resp, body, work, "generate")

    @staticmethod
    def _infill(body: dict) -> dict:
        """A code model's fill-in-the-middle prompt (native/fim.py), as Ollama's FIM templates
        make it. What that prompt has no place for is refused rather than dropped."""
        if not isinstance(body["suffix"], str):
            raise bad("suffix", "suffix must be a string (the text after the gap)", "invalid_type")
        for k in ("raw", "system", "format", "think"):
            if body.get(k) not in (None, False, ""):
                raise bad(k, f"{k} cannot be combined with suffix (a fill-in-the-middle prompt has no place for it)")
        return {"prefix": body["prompt"], "suffix": body["suffix"]}

    def _embed_options(self, body: dict, route: dict) -> None:
        """Embeddings take no sampling: an option that would change a generation is refused by
        name; num_ctx is checked against the worker's context, hardware ones are Kiln's to decide."""
        opts = body.get("options") or {}
        if not isinstance(opts, dict):
            raise bad("options", "options must be an object", "invalid_type")
        for k in opts:
            if k not in HARDWARE_OPTIONS and k != "num_ctx":
                raise bad(f"options.{k}", f"option {k!r} has no effect on embeddings (supported: num_ctx)")
        self._check_ctx(body, route)

    def _embed(self, req, body: dict, items: list[str], normalize: bool) -> tuple[list[list[float]], int]:
        route = self._route(req, body)
        self._embed_options(body, route)
        work = {"inputs": items, "worker": route["worker"], "normalize": normalize}
        if body.get("dimensions") is not None:
            work["dimensions"] = body["dimensions"]
        if body.get("keep_alive") is not None:
            from .openai_validate import keep_alive
            work.update(keep_alive(body))
        import numpy as np
        out = routed(self.sup, "embed", work, 600, "input")
        req.context.usage = {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": 0}
        return [np.frombuffer(v, "<f4").tolist() for v in out["embeddings"]], out["usage"]["prompt_tokens"]

    def on_post_embed(self, req, resp):
        body = self._body(req, {"model", "input", "truncate", "options", "keep_alive", "dimensions"})
        inp = body.get("input")
        items = [inp] if isinstance(inp, str) else inp
        if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
            raise bad("input", "input must be a non-empty string or a list of them")
        if body.get("truncate") is True:
            raise bad("truncate", "truncate is not supported: Kiln refuses an input longer than the context "
                      "instead of cutting it; set truncate: false")
        t0 = time.perf_counter()
        vectors, n = self._embed(req, body, items, normalize=True)
        resp.media = {"model": body["model"], "embeddings": vectors, "total_duration": _ns(time.perf_counter() - t0),
                      "load_duration": 0, "prompt_eval_count": n}

    def on_post_embeddings(self, req, resp):
        """The legacy route: one prompt, its embedding not normalised (as Ollama's); an empty
        prompt loads the model and answers an empty embedding."""
        body = self._body(req, {"model", "prompt", "options", "keep_alive"})
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "prompt must be a string", "invalid_type")
        if not prompt:
            self._embed_options(body, self._route(req, body))
            resp.media = {"embedding": []}
            return
        vectors, _ = self._embed(req, body, [prompt], normalize=False)
        resp.media = {"embedding": vectors[0]}


def _args(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def install(app: falcon.App, sup, api) -> None:
    o = Ollama(sup, api)
    for route in ("version", "ps", "chat", "generate", "embed", "embeddings"):
        app.add_route(f"/api/{route}", o, suffix=route)
    ollama_library.install(app, sup, api)
