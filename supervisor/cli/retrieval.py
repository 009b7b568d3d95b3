"""`kiln embed` and `kiln rerank`: a retrieval model's answers through the daemon (starting one if
none runs), as /v1/embeddings and /v1/rerank give them."""

from __future__ import annotations

import json
from typing import Optional

import typer

from .chat import _ensure_daemon
from .engine import fail


def _routed(op: str, body: dict, model: Optional[str]) -> dict:
    from ..bus.client import CommandFailed
    client = _ensure_daemon(model)
    if model:
        body["model"] = model
    try:
        *_, reply = client.stream(op, {**body, "timeout": 600}, timeout=600)
    except CommandFailed as e:
        fail(f"{e.code}: {e.message}")
    return reply.body


def rerank(query: str = typer.Argument(..., help="what the documents are ranked against"),
           documents: list[str] = typer.Argument(..., help="the texts to rank"),
           model: Optional[str] = typer.Option(None, "--model", "-m", help="a reranking model (default: the "
                                                                           "daemon's default model)"),
           top_n: Optional[int] = typer.Option(None, "--top-n", min=1, help="show only the best N"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Rank DOCUMENTS by their relevance to QUERY with a reranking model (bge-reranker and other
    BERT-family cross-encoders), best first."""
    out = _routed("rerank", {"query": query, "documents": list(documents)}, model)
    order = sorted(range(len(documents)), key=lambda i: -out["scores"][i])[:top_n or len(documents)]
    results = [{"index": i, "relevance_score": out["scores"][i], "document": documents[i]} for i in order]
    if as_json:
        typer.echo(json.dumps({"results": results, "usage": out["usage"]}))
        return
    for r in results:
        typer.echo(f"{r['relevance_score']:>10.4f}  [{r['index']}] {r['document']}")


def embed(texts: list[str] = typer.Argument(..., help="the texts to embed"),
          model: Optional[str] = typer.Option(None, "--model", "-m", help="an embedding model (default: the "
                                                                          "daemon's default model)"),
          dimensions: Optional[int] = typer.Option(None, "--dimensions", min=1, help="keep the first N components "
                                                                                     "(Matryoshka models)")):
    """Embed TEXTS (normalised vectors, one JSON array per line) with an embedding model."""
    import numpy as np
    body = {"inputs": list(texts), **({"dimensions": dimensions} if dimensions else {})}
    out = _routed("embed", body, model)
    for v in out["embeddings"]:
        typer.echo(json.dumps([round(float(x), 7) for x in np.frombuffer(v, "<f4")]))
