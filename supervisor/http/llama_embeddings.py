"""llama-server's own embedding routes: POST /embedding and /embeddings (its non-OpenAI shape).

`content` (or `input`): a string, token ids, or a list of those; `embd_normalize` as llama-server
(-1 none, 0 max absolute, 2 euclidean — the default —, p > 2 a p-norm). The answer is a list of
`{"index", "embedding"}` where `embedding` is a list of vectors: one, pooled and normalised, or —
for a model whose file pools nothing — one per token, not normalised (as llama-server)."""

from __future__ import annotations

import numpy as np

from .inputs import embedding_inputs
from .openai_validate import bad, keep_alive, known_fields
from .pipeline import Pipeline
from .work import model_of

FIELDS = {"content", "input", "embd_normalize", "encoding_format", "model", "keep_alive"}


class LlamaEmbeddings:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post(self, req, resp):
        body = self.pipe.read_json(req)
        known_fields(body, FIELDS)
        if "content" in body and "input" in body:
            raise bad("content", "give content or input, not both")
        if body.get("encoding_format", "float") != "float":
            raise bad("encoding_format", "this route answers float lists only (base64 is /v1/embeddings')")
        key = "content" if "content" in body else "input"
        if key not in body:
            raise bad("content", "content (or input) is required: a string, token ids, or a list of them")
        items = embedding_inputs({"input": body[key]})
        norm = body.get("embd_normalize", 2)
        if isinstance(norm, bool) or not isinstance(norm, int) or not (norm in (-1, 0) or 2 <= norm <= 64):
            raise bad("embd_normalize", "embd_normalize is -1 (none), 0 (max absolute), 2 (euclidean) or a p-norm "
                                        "up to 64", "invalid_value")
        work = {"inputs": items, "embd_normalize": norm, "per_token": True, **keep_alive(body)}
        if model_of(body):
            work["model"] = model_of(body)
        out, _ = self.pipe.call(req, "embed", work, 600, key)
        req.context.usage = {"prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": 0}
        rows = out.get("rows")
        result = []
        for i, raw in enumerate(out["embeddings"]):
            v = np.frombuffer(raw, "<f4")
            vectors = v.reshape(rows[i], -1) if rows else v[None]
            result.append({"index": i, "embedding": vectors.tolist()})
        resp.media = result


def install(app, pipe: Pipeline) -> None:
    api = LlamaEmbeddings(pipe)
    app.add_route("/embedding", api)
    app.add_route("/embeddings", api)
