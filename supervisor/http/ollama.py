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

from .images import Images, b64_parts
from . import ollama_library
from .common import JSONError, bus, context_notes, token_logprobs
from .pipeline import Pipeline, Shape, stream_flag
from .llama_fields import llama_params
from .common import ndjson
from .ollama_library import details, file_digest, file_of, ollama_name
from .openai_validate import bad, keep_alive, messages as check_messages, sampling_params, tools as check_tools
from .work import Work

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
_CHAT_FIELDS = {"model", "messages", "stream", "format", "options", "tools", "think", "keep_alive", "logprobs",
                "top_logprobs", "truncate", "shift"}
_GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "stream", "format", "options", "think", "keep_alive", "raw",
                    "logprobs", "top_logprobs", "shift", "images"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class Ollama:
    def __init__(self, sup, pipe: Pipeline):
        self.sup, self.pipe = sup, pipe

    # -- helpers -------------------------------------------------------------------------------

    def _body(self, req, allowed: set[str]) -> dict:
        body = self.pipe.read_json(req)
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
            if k in ("num_ctx", "num_keep"):
                continue                          # num_ctx: checked against the worker's context below
            if k in _LLAMA_OPTIONS:
                continue                          # below
            if k not in _OPTIONS:
                raise bad(f"options.{k}", f"option {k!r} is not supported (supported: "
                          f"{', '.join(sorted(set(_OPTIONS) | {'num_ctx', 'num_keep', 'repeat_last_n', 'mirostat'}))})")
            if k == "num_predict" and isinstance(v, int) and v < 0:
                continue                          # -1: until the context ends (Kiln's default)
            out[_OPTIONS[k]] = v
        p = sampling_params(out)
        keep = opts.get("num_keep")             # what a context shift keeps (shift: true)
        if keep is not None:
            if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
                raise bad("options.num_keep", "num_keep must be an integer ≥ -1 (-1: the whole prompt)")
            p["n_keep"] = keep
        # repeat_last_n, and mirostat only at 0 (off)
        p.update(llama_params({k: opts[k] for k in _LLAMA_OPTIONS if k in opts}))
        return p

    @staticmethod
    def _logprobs(body: dict) -> dict:
        """logprobs: each token's log-probability in the answer; top_logprobs (0–20): that many
        likeliest alternatives with each — the engine's `logprobs` parameter."""
        on, top = body.get("logprobs"), body.get("top_logprobs")
        if on is not None and not isinstance(on, bool):
            raise bad("logprobs", "logprobs must be a boolean", "invalid_type")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            raise bad("top_logprobs", "top_logprobs must be an integer from 0 to 20")
        if top and not on:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return {"logprobs": top or 0} if on else {}

    @staticmethod
    def _min_ctx(body: dict) -> dict:
        """num_ctx: the context the client needs — a worker whose context is shorter refuses it."""
        want = (body.get("options") or {}).get("num_ctx")
        if want is None:
            return {}
        if not isinstance(want, int) or isinstance(want, bool) or want <= 0:
            raise bad("options.num_ctx", "num_ctx must be a positive integer")
        return {"min_ctx": want}

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

    def _run(self, req, resp, body: dict, given: dict, kind: str) -> None:
        """Generate and answer in Ollama's shape: NDJSON chunks, or one object."""
        params = self._options(body)              # first: it checks that options is an object
        params.update(self._logprobs(body))
        params.update(self._shift(body))
        work = Work(**given, model=body["model"], params=params, **self._min_ctx(body), **keep_alive(body))
        shape = OllamaShape(kind, body["model"], with_lp=body.get("logprobs") is True)
        self.pipe.generate(req, resp, work, shape, stream_flag(body, default=True))

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
            pics = m.get("images")
            m = {k: v for k, v in m.items() if k not in ("images", "thinking")}
            if pics:
                m["content"] = b64_parts(pics, m.get("content"), f"messages[{i}]")
            if m.get("tool_calls"):
                m["tool_calls"] = [{"id": f"call_{j}", "type": "function", "function": {
                    "name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments", {})}}
                    for j, c in enumerate(m["tool_calls"])]
            if "tool_name" in m:
                m["name"] = m.pop("tool_name")
            conv.append(m)
        oa = {"messages": conv, "tools": body.get("tools"), **self._format(body), **self._think(body)}
        images = Images()
        given = {"messages": check_messages(oa, images), **check_tools({k: v for k, v in oa.items() if v is not None}),
                 **self._truncate(body), **images.work()}
        self._run(req, resp, body, given, "chat")

    @staticmethod
    def _truncate(body: dict) -> dict:
        """truncate: true drops the oldest messages (after the system ones) until the prompt fits,
        as Ollama's chat does; Kiln's default (false) is the 400 that says the prompt is too long."""
        if body.get("truncate") is not None and not isinstance(body["truncate"], bool):
            raise bad("truncate", "truncate must be a boolean", "invalid_type")
        return {"truncation": "auto"} if body.get("truncate") else {}

    @staticmethod
    def _shift(body: dict) -> dict:
        """shift: true slides the context when an answer reaches its end (keeping options.num_keep
        tokens, dropping half of the rest) instead of stopping there — Kiln's context_shift; off
        unless asked (or the worker's context_shift setting is on)."""
        if body.get("shift") is not None and not isinstance(body["shift"], bool):
            raise bad("shift", "shift must be a boolean", "invalid_type")
        return {} if body.get("shift") is None else {"context_shift": body["shift"]}

    def on_post_generate(self, req, resp):
        body = self._body(req, _GENERATE_FIELDS)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "prompt must be a string", "invalid_type")
        if body.get("suffix") is not None:        # fill in the middle: prompt is the code before the gap
            return self._run(req, resp, body, {"infill": self._infill(body)}, "generate")
        if not prompt:                            # Ollama: an empty prompt loads the model
            _, worker = self.pipe.call(req, "info", {"model": body["model"]}, 600, shape=OllamaShape("generate", ""))
            resp.media = {"model": body["model"], "created_at": _now(), "response": "", "done": True,
                          "done_reason": "load", "worker": worker}
            return
        if body.get("raw"):
            if body.get("system"):
                raise bad("system", "system cannot be combined with raw")
            if body.get("images"):
                raise bad("images", "a raw prompt takes no images (Kiln does not know where they go in it); "
                                    "leave raw out, and the model's template places them")
            given = {"text": prompt, "special": True}
        else:
            user = b64_parts(body["images"], prompt, "images") if body.get("images") else prompt
            msgs = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + \
                [{"role": "user", "content": user}]
            oa = {"messages": msgs, **self._format(body), **self._think(body)}
            images = Images()
            given = {"messages": check_messages(oa, images), **check_tools(oa), **images.work()}
        self._run(req, resp, body, given, "generate")

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

    def _embed_options(self, body: dict) -> dict:
        """Embeddings take no sampling: an option that would change a generation is refused by
        name; num_ctx is checked against the worker's context, hardware ones are Kiln's to decide."""
        opts = body.get("options") or {}
        if not isinstance(opts, dict):
            raise bad("options", "options must be an object", "invalid_type")
        for k in opts:
            if k not in HARDWARE_OPTIONS and k != "num_ctx":
                raise bad(f"options.{k}", f"option {k!r} has no effect on embeddings (supported: num_ctx)")
        return self._min_ctx(body)

    def _embed(self, req, body: dict, items: list[str], normalize: bool,
               truncate: bool = False) -> tuple[list[list[float]], int]:
        work = {"inputs": items, "model": body["model"], "normalize": normalize, **self._embed_options(body),
                **keep_alive(body), **({"truncate": True} if truncate else {})}
        if body.get("dimensions") is not None:
            work["dimensions"] = body["dimensions"]
        import numpy as np
        out, _ = self.pipe.call(req, "embed", work, 600, "input", shape=OllamaShape("embed", ""))
        req.context.usage = {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": 0}
        return [np.frombuffer(v, "<f4").tolist() for v in out["embeddings"]], out["usage"]["prompt_tokens"]

    def on_post_embed(self, req, resp):
        body = self._body(req, {"model", "input", "truncate", "options", "keep_alive", "dimensions"})
        inp = body.get("input")
        items = [inp] if isinstance(inp, str) else inp
        if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
            raise bad("input", "input must be a non-empty string or a list of them")
        truncate = body.get("truncate", True)       # Ollama's default: cut an input to the context
        if not isinstance(truncate, bool):
            raise bad("truncate", "truncate must be true or false", "invalid_type")
        t0 = time.perf_counter()
        vectors, n = self._embed(req, body, items, normalize=True, truncate=truncate)
        resp.media = {"model": body["model"], "embeddings": vectors, "total_duration": _ns(time.perf_counter() - t0),
                      "load_duration": 0, "prompt_eval_count": n}

    def on_post_embeddings(self, req, resp):
        """The legacy route: one prompt, its embedding not normalised (as Ollama's); an empty
        prompt loads the model and answers an empty embedding."""
        body = self._body(req, {"model", "prompt", "options", "keep_alive"})
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad("prompt", "prompt must be a string", "invalid_type")
        if not prompt:                            # loads the model
            self.pipe.call(req, "info", {"model": body["model"], **self._embed_options(body)}, 600,
                           shape=OllamaShape("embed", ""))
            resp.media = {"embedding": []}
            return
        vectors, _ = self._embed(req, body, [prompt], normalize=False)
        resp.media = {"embedding": vectors[0]}


def _args(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class OllamaShape(Shape):
    """An Ollama answer: NDJSON objects (`done: false` parts, then the closing one with its counts
    and durations in nanoseconds), or the closing object with everything in it."""

    media = "application/x-ndjson"
    keepalive = None                        # NDJSON has no comment to send in a silence

    def __init__(self, kind: str, model: str, with_lp: bool = False):
        self.kind, self.model, self.t0, self.with_lp = kind, model, time.perf_counter(), with_lp
        self.param = "messages" if kind == "chat" else "prompt"

    def start(self, model: str) -> None:
        pass                                # Ollama's answers name the model as the request did

    def refused(self, err: JSONError) -> JSONError:
        if err.kiln_body["error"].get("code") == "model_not_found":
            return JSONError(404, "model_not_found", err.kiln_body["error"]["message"])
        return err

    def _said(self, text="", reasoning="", calls=()) -> dict:
        if self.kind == "chat":
            msg = {"role": "assistant", "content": text}
            if reasoning:
                msg["thinking"] = reasoning
            if calls:
                msg["tool_calls"] = [{"function": {"name": c["name"], "arguments": _args(c["arguments"])}}
                                     for c in calls]
            return {"message": msg}
        out = {"response": text}
        if reasoning:
            out["thinking"] = reasoning
        return out

    def _closing(self, final: dict) -> dict:
        u, tm = final["usage"], final.get("timings") or {}
        reason = final["finish_reason"]
        return {"model": self.model, "created_at": _now(), **self._said(), "done": True,
                "done_reason": "length" if reason == "length" else "stop",
                "total_duration": _ns(time.perf_counter() - self.t0), "load_duration": 0,
                "prompt_eval_count": u["prompt_tokens"] - u.get("cached_tokens", 0),
                "prompt_eval_duration": _ns(tm.get("prefill_s", 0)),
                "eval_count": u["completion_tokens"], "eval_duration": _ns(tm.get("decode_s", 0)),
                **context_notes(final)}

    def _logprobs(self, parts: list[dict]) -> dict:
        """Ollama's `logprobs`: one entry per generated token (its alternatives when asked)."""
        if not self.with_lp:
            return {}
        return {"logprobs": [{k: v for k, v in e.items() if k != "top_logprobs" or v}
                             for e in token_logprobs(parts)]}

    def part(self, b: dict):
        if b.get("text") or b.get("reasoning") or b.get("tool_calls") or (self.with_lp and "logprob" in b):
            yield ndjson({"model": self.model, "created_at": _now(), **self._said(
                b.get("text", ""), b.get("reasoning", ""), b.get("tool_calls", ())), **self._logprobs([b]),
                "done": False})

    def closing(self, final: dict):
        yield from self.part(final)
        yield ndjson(self._closing(final))

    def failed(self, err: JSONError):
        yield ndjson({"error": err.kiln_body["error"]["message"]})

    def whole(self, parts: list[dict], final: dict) -> dict:
        every = parts + [final]
        out = self._closing(final)
        out.update(self._said("".join(p.get("text", "") for p in every), "".join(p.get("reasoning", "") for p in every),
                              [c for p in every for c in p.get("tool_calls", [])]), **self._logprobs(parts))
        return out


def install(app: falcon.App, sup, pipe: Pipeline) -> None:
    o = Ollama(sup, pipe)
    for route in ("version", "ps", "chat", "generate", "embed", "embeddings"):
        app.add_route(f"/api/{route}", o, suffix=route)
    ollama_library.install(app, sup, pipe)

