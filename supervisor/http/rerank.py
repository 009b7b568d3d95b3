"""Reranking: POST /v1/rerank, /rerank, /v1/reranking, /reranking — llama-server's routes, in
its shape (Jina's and Cohere's: `query`, `documents`, `top_n`, `return_documents`; results sorted
by `relevance_score`, highest first) or, when the body sends `texts`, Hugging Face TEI's (a list of
`{index, score}`, `return_text`). The model must be a reranker (an encoder whose pooling is rank);
any other is a 400 saying so."""

from __future__ import annotations

import falcon

from .openai_validate import bad, keep_alive, known_fields, number
from .pipeline import Pipeline
from .work import model_of

FIELDS = {"model", "query", "documents", "top_n", "return_documents", "keep_alive"}
TEI_FIELDS = {"model", "query", "texts", "return_text", "truncate", "keep_alive"}
MAX_DOCUMENTS = 1024


def _documents(body: dict, key: str) -> list[str]:
    """Strings, or Cohere's `{"text": …}` objects."""
    docs = body.get(key)
    if not isinstance(docs, list) or not docs:
        raise bad(key, f"{key} must be a non-empty array of strings", "invalid_type")
    if len(docs) > MAX_DOCUMENTS:
        raise bad(key, f"at most {MAX_DOCUMENTS} documents per request, got {len(docs)}")
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, dict) and set(d) == {"text"}:
            d = d["text"]
        if not isinstance(d, str):
            raise bad(f"{key}[{i}]", f'{key}[{i}] must be a string (or {{"text": string}})', "invalid_type")
        out.append(d)
    return out


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool):
        raise bad(key, f"{key} must be true or false", "invalid_type")
    return v


class Rerank:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def on_post(self, req, resp):
        body = self.pipe.read_json(req)
        tei = "texts" in body
        known_fields(body, TEI_FIELDS if tei else FIELDS)
        query = body.get("query")
        if not isinstance(query, str):
            raise bad("query", "query must be a string" if "query" in body else "query is required", "invalid_type")
        docs = _documents(body, "texts" if tei else "documents")
        if tei and body.get("truncate") not in (None, False):
            raise bad("truncate", "truncate is not supported: Kiln refuses a pair longer than the context instead of "
                      "cutting it; leave truncate out")
        top_n = number(body, "top_n", 1, MAX_DOCUMENTS, int) or len(docs)
        show = _flag(body, "return_text" if tei else "return_documents")
        work = {"query": query, "documents": docs, **keep_alive(body)}
        if model_of(body):
            work["model"] = model_of(body)
        out, name = self.pipe.call(req, "rerank", work, 600, "documents")
        n = out["usage"]["prompt_tokens"]
        req.context.usage = {"prompt_tokens": n, "completion_tokens": 0}
        label = "score" if tei else "relevance_score"
        ranked = sorted(range(len(docs)), key=lambda i: -out["scores"][i])[:top_n]
        results = []
        for i in ranked:
            r = {"index": i, label: out["scores"][i]}
            if show:
                r |= {"text": docs[i]} if tei else {"document": {"text": docs[i]}}
            results.append(r)
        if tei:
            resp.media = results
            return
        resp.media = {"model": body.get("model") or name, "object": "list", "results": results,
                      "usage": {"prompt_tokens": n, "total_tokens": n}}
        resp.status = falcon.HTTP_200


def install(app: falcon.App, pipe: Pipeline) -> None:
    api = Rerank(pipe)
    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):
        app.add_route(path, api)
