"""llama-server's native routes: `POST /completion`, `POST /infill` (code infilling), and its
tokenizer and info routes (`/tokenize`, `/detokenize`, `/apply-template`, `GET /tokenizer_info`,
`GET /props`).

For tools and editor plugins written against llama-server rather than an OpenAI-style API. The
answer is llama-server's native completion object (`content`, `tokens`, `stop`, `stop_type`,
`tokens_predicted`, `tokens_evaluated`, `tokens_cached`, `timings`, …), streamed as `data: {…}`
events with no `[DONE]`, as llama-server streams these routes.

`/infill` names the code before and after the cursor (`input_prefix`, `input_suffix`), other
files for context (`input_extra`: [{filename, text}]) and the start of the middle already typed
(`prompt`); the worker lays them out as llama-server does (native/fim.py, repo-level).

What llama.vim and llama.vscode send works: `samplers` (a chain of llama.cpp's samplers in
order, its `infill` sampler included — native/sampling.py), `n_indent`, `t_max_predict_ms`
(native/generate.py), `n_predict: 0` (the prompt is only cached: they send other files ahead of
time), `response_fields`. Two fields are accepted that change nothing, because llama-server does
nothing with them either: `t_max_prompt_ms` (its "TODO: implement") and an `input_extra` item's
`time` (the plugin's own bookkeeping). Its sampling knobs are llama_fields.py's (off values
accepted, others refused); `lora` picks the request's adapter and its scale (llama_lora.py);
`id_slot` and the rest are refused by name.
"""

from __future__ import annotations

import json

from .images import media_prompt
from .common import token_logprobs
from .pipeline import Pipeline, Shape, stream_flag
from .llama_fields import FIELDS as LLAMA_FIELDS, KILN_ORDER, llama_params
from .openai_validate import (adapter, bad, context_shift, grammar, keep_alive, known_fields, messages,
                              sampling_params, tools)
from .work import Work, model_of

_SAMPLING = {"temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "stop", "repeat_penalty",
             "presence_penalty", "frequency_penalty", "ignore_eos", "logit_bias"}
_COMMON = {"model", "stream", "n_predict", "max_tokens", "adapter", "adapter_scale", "lora", "keep_alive", "n_indent", "t_max_predict_ms",
           "t_max_prompt_ms", "response_fields", "grammar", "json_schema", "return_tokens",
           "post_sampling_probs", "context_shift", "n_keep", "n_discard"} | _SAMPLING | LLAMA_FIELDS
FIELDS = _COMMON | {"input_prefix", "input_suffix", "input_extra", "prompt"}
COMPLETION_FIELDS = _COMMON | {"prompt"}
def infill_work(body: dict) -> dict:
    """The generate op's `infill` field from an /infill body (400 naming a bad field)."""
    texts = {}
    for field, key in (("input_prefix", "prefix"), ("input_suffix", "suffix"), ("prompt", "middle")):
        v = body.get(field, "")
        if not isinstance(v, str):
            raise bad(field, f"{field} must be a string", "invalid_type")
        texts[key] = v
    extra = body.get("input_extra") or []
    if not isinstance(extra, list):
        raise bad("input_extra", "input_extra must be a list of {\"filename\", \"text\"} objects", "invalid_type")
    files = []
    for i, chunk in enumerate(extra):
        # "time": llama.vim's own bookkeeping, which llama-server ignores too
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str) or \
                not isinstance(chunk.get("filename", "tmp"), str) or set(chunk) - {"filename", "text", "time"}:
            raise bad(f"input_extra[{i}]", "each input_extra item is {\"filename\": string, \"text\": string}")
        files.append([chunk.get("filename", "tmp"), chunk["text"]])
    return {**texts, "extra": files, "repo_level": True}


def _params(body: dict) -> dict:
    if "n_predict" in body and "max_tokens" in body:
        raise bad("n_predict", "give n_predict or max_tokens, not both")
    n = body.get("n_predict", body.get("max_tokens"))
    which = "n_predict" if "n_predict" in body else "max_tokens"
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < -1):
        raise bad(which, f"{which} must be -1 (until the model stops or the context ends), 0 (only cache "
                         f"the prompt) or a number of tokens")
    params = sampling_params({k: v for k, v in body.items() if k in _SAMPLING})
    params.update(context_shift(body))      # n_keep / n_discard: what a shift keeps and drops
    params["max_tokens"] = -1 if n is None else n
    # nothing is sampled with n_predict 0; n_probs is this route's own (below)
    params.update(llama_params({k: v for k, v in body.items() if k != "n_probs"}, sampling=n != 0))
    params.update(_probs(body))
    for field, low in (("n_indent", 0), ("t_max_predict_ms", None), ("t_max_prompt_ms", None)):
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or (field == "n_indent" and (not isinstance(v, int) or v < low))):
            raise bad(field, f"{field} must be a {'non-negative integer' if field == 'n_indent' else 'number'}")
    if body.get("n_indent"):
        params["n_indent"] = body["n_indent"]
    if (body.get("t_max_predict_ms") or 0) > 0:          # llama-server: ≤ 0 is no limit
        params["t_max_predict_ms"] = float(body["t_max_predict_ms"])
    return params


def _probs(body: dict) -> dict:
    """n_probs: each generated token's log-probability and its n likeliest alternatives
    (llama-server's `completion_probabilities`) — the engine's `logprobs` parameter."""
    n = body.get("n_probs")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 20):
        raise bad("n_probs", "n_probs must be an integer from 0 to 20 (the alternatives given with each token)")
    if body.get("post_sampling_probs") not in (None, False):
        raise bad("post_sampling_probs", "post_sampling_probs is not supported: Kiln gives the model's "
                                         "log-probabilities before sampling; leave it out or set it false")
    return {"logprobs": n} if n else {}


def _fields(out: dict, paths) -> dict:
    """llama-server's response_fields: only these paths ("timings/prompt_n"), flat, by path."""
    if not isinstance(paths, list) or not all(isinstance(x, str) for x in paths):
        raise bad("response_fields", "response_fields must be a list of paths", "invalid_type")
    picked = {}
    for path in paths:
        node = out
        for key in path.split("/"):
            node = node.get(key, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            picked[path] = node
    return picked


_MISSING = object()


def completion_work(body: dict) -> dict:
    """/completion's prompt: a string (its special tokens parsed, as llama-server does), token ids,
    or llama-server's multimodal object {"prompt_string": …, "multimodal_data": [base64, …]}, an
    image where each <__media__> marker is."""
    prompt = body.get("prompt")
    if isinstance(prompt, dict):
        return media_prompt(prompt)
    if isinstance(prompt, str) and prompt:
        return {"text": prompt, "special": True}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt": prompt}
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids (one prompt per request; "
                        "/v1/completions takes several)", "invalid_type")


class LlamaServer:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post_infill(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, FIELDS)
        self._answer(req, resp, body, {"infill": infill_work(body)})

    def on_post_completion(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, COMPLETION_FIELDS)
        self._answer(req, resp, body, completion_work(body))

    def _answer(self, req, resp, body: dict, given: dict) -> None:
        # the token ids come only when asked (llama-server's return_tokens), else `tokens: []`
        ids = body.get("return_tokens", False)
        if not isinstance(ids, bool):
            raise bad("return_tokens", "return_tokens must be a boolean", "invalid_type")
        from .llama_lora import lora_field
        work = Work(**given, model=model_of(body), params=_params(body), **grammar(body), **adapter(body),
                    **lora_field(self.pipe.sup, body), **keep_alive(body))
        if body.get("response_fields") is not None:
            _fields({}, body["response_fields"])
        shape = CompletionShape(body.get("response_fields"), ids, probs=bool(work.params.get("logprobs")))
        self.pipe.generate(req, resp, work, shape, stream_flag(body))


def _closing(final: dict, model: str, content: str, tokens: list[int]) -> dict:
    """llama-server's last completion object: what ended it, the counts and the timings."""
    u, tm = final["usage"], final.get("timings") or {}
    reason = final["finish_reason"]
    stop_type = "limit" if reason == "length" else "word" if final.get("stop_string") is not None else "eos"
    n_prompt = u["prompt_tokens"] - u.get("cached_tokens", 0)
    prefill_ms, decode_ms = 1000 * tm.get("prefill_s", 0.0), 1000 * tm.get("decode_s", 0.0)
    return {"index": 0, "content": content, "tokens": tokens, "stop": True, "model": model,
            "tokens_predicted": u["completion_tokens"], "tokens_evaluated": u["prompt_tokens"],
            "tokens_cached": u.get("cached_tokens", 0),
            # llama-server's word that the context shifted during the answer
            "truncated": bool(final.get("context_shifts")), "stop_type": stop_type,
            "stopping_word": final.get("stop_string") or "", "has_new_line": "\n" in content,
            "timings": {"prompt_n": n_prompt, "prompt_ms": prefill_ms,
                        "prompt_per_token_ms": prefill_ms / n_prompt if n_prompt else 0.0,
                        "prompt_per_second": n_prompt / (prefill_ms / 1000) if prefill_ms else 0.0,
                        "predicted_n": u["completion_tokens"], "predicted_ms": decode_ms,
                        "predicted_per_token_ms": decode_ms / u["completion_tokens"] if u["completion_tokens"] else 0.0,
                        "predicted_per_second": u["completion_tokens"] / (decode_ms / 1000) if decode_ms else 0.0}}


class CompletionShape(Shape):
    """llama-server's completion object, whole or as `data:` events (no [DONE]); `fields`: its
    response_fields, `ids`: its return_tokens, `probs`: its n_probs > 0."""

    param = "prompt"

    def __init__(self, fields, ids: bool, probs: bool = False):
        self.fields, self.ids, self.probs, self.n = fields, ids, probs, 0

    def _data(self, obj: dict) -> bytes:
        obj = obj if self.fields is None or "error" in obj else _fields(obj, self.fields)
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def part(self, b: dict):
        self.n += 1
        yield self._data({"index": 0, "content": b.get("text", ""), "tokens": [b["token"]] if self.ids else [],
                          "stop": False, "tokens_predicted": self.n,
                          **({"completion_probabilities": token_logprobs([b], ids=True)} if self.probs else {})})

    def closing(self, final: dict):
        yield self._data(_closing(final, self.model, final.get("text", ""), []))

    def failed(self, err):
        yield self._data(err.kiln_body)

    def whole(self, parts: list[dict], final: dict) -> dict:
        content = "".join(p.get("text", "") for p in parts) + final.get("text", "")
        out = _closing(final, self.model, content, [p["token"] for p in parts] if self.ids else [])
        if self.probs:
            out["completion_probabilities"] = token_logprobs(parts, ids=True)
        return out if self.fields is None else _fields(out, self.fields)


class Utility:
    """llama-server's GET /props, and its tokenizer routes with its defaults: /tokenize parses special-token text
    (`parse_special`, default true) and adds BOS only when asked (`add_special`) and the model
    wants it; `with_pieces` gives each token's text (its bytes where they are not UTF-8)."""

    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post_tokenize(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, {"model", "content", "prompt", "add_special", "parse_special", "with_pieces"})
        text = body.get("content", body.get("prompt"))
        if not isinstance(text, str):
            raise bad("content", "content must be a string", "invalid_type")
        flags = {}
        for name, default in (("add_special", False), ("parse_special", True), ("with_pieces", False)):
            flags[name] = body.get(name, default)
            if not isinstance(flags[name], bool):
                raise bad(name, f"{name} must be a boolean", "invalid_type")
        out, _ = self.pipe.call(req, "tokenize", {**_model(body), "text": text, "special": flags["parse_special"],
                                                  "pieces": flags["with_pieces"],
                                                  # BOS only as the model's metadata asks, and only when asked
                                                  **({} if flags["add_special"] else {"add_bos": False})})
        if not flags["with_pieces"]:
            resp.media = {"tokens": out["tokens"]}
            return
        pieces = []
        for tid, raw in zip(out["tokens"], out["pieces"]):
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": tid, "piece": piece})
        resp.media = {"tokens": pieces}

    def on_post_detokenize(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, {"model", "tokens"})
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise bad("tokens", "tokens must be a list of token ids", "invalid_type")
        text = self.pipe.call(req, "detokenize", {**_model(body), "tokens": toks})[0]["text"]
        resp.media = {"content": text, "prompt": text}

    def on_post_template(self, req, resp):
        """The prompt a chat request runs: with tools, template kwargs or an effort, exactly the
        one generate would (the worker's chat plan)."""
        body = self.pipe.read_json(req)
        known_fields(body, {"model", "messages", "tools", "tool_choice", "parallel_tool_calls",
                            "chat_template_kwargs", "reasoning_effort", "add_generation_prompt"})
        work = {"messages": messages(body), **tools(body)}
        if body.get("add_generation_prompt") is not None:
            if not isinstance(body["add_generation_prompt"], bool):
                raise bad("add_generation_prompt", "add_generation_prompt must be a boolean", "invalid_type")
            work["add_generation_prompt"] = body["add_generation_prompt"]
        out, _ = self.pipe.call(req, "apply_template", {**_model(body), **work})
        resp.media = {"prompt": out["prompt"], "tokens": out["tokens"]}

    def on_get_props(self, req, resp):
        """llama-server's GET /props (its web UI and plugins read the context and template from
        it): the default model's — or `?model=`'s — facts, and the defaults a request gets."""
        info, _ = self.pipe.call(req, "info", _model({"model": req.get_param("model")}))
        from kiln.native.sampling import SamplingParams
        d = SamplingParams()
        resp.media = {
            "default_generation_settings": {
                "n_ctx": info["n_ctx"], "model": info["path"],
                "params": {"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                           "typical_p": d.typical_p, "repeat_last_n": d.repeat_last_n,
                           "repeat_penalty": d.repeat_penalty, "presence_penalty": d.presence_penalty,
                           "frequency_penalty": d.frequency_penalty, "n_predict": -1,
                           "samplers": KILN_ORDER}},
            "total_slots": info["slots"], "model_path": info["path"], "chat_template": info["chat_template"] or "",
            "bos_token": info["bos_token"], "eos_token": info["eos_token"],
            "modalities": {"vision": bool(info.get("vision")), "audio": False}, "infill": info["fill_in_the_middle"],
            "build_info": f"kiln {_version()}"}

    def on_get_tokenizer_info(self, req, resp):
        info, _ = self.pipe.call(req, "info", _model({"model": req.get_param("model")}))
        resp.media = {k: info[k] for k in ("bos_token", "eos_token", "chat_template", "vocab_size", "n_ctx")}


def _model(body: dict) -> dict:
    model = model_of(body)
    return {"model": model} if model else {}


def install(app, sup, pipe: Pipeline) -> None:
    tok = Utility(pipe)
    app.add_route("/tokenize", tok, suffix="tokenize")
    app.add_route("/detokenize", tok, suffix="detokenize")
    app.add_route("/apply-template", tok, suffix="template")
    app.add_route("/tokenizer_info", tok, suffix="tokenizer_info")
    app.add_route("/props", tok, suffix="props")
    native = LlamaServer(pipe)
    app.add_route("/infill", native, suffix="infill")
    app.add_route("/completion", native, suffix="completion")
    from .llama_lora import LoraAdapters
    app.add_route("/lora-adapters", LoraAdapters(sup))
    app.add_route("/completions", native, suffix="completion")        # llama-server's alias


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kiln")
    except PackageNotFoundError:
        return "unknown"
