"""Ollama's model-library routes on Kiln's port: /api/tags, show, pull, delete, copy — the
GGUF files in Kiln's model folders under Ollama's names (`name:latest`) — and the shapes they
share with the generation routes (supervisor/ollama_api.py). /api/create, push and blobs answer
501 with what Kiln does instead: there is no Ollama registry and no Modelfile here."""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from .common import JSONError, bus
from .request_paths import check_model_ref, library_entry
from .openai_validate import bad


_FILE_STEM = re.compile(r"\w[\w.+-]{0,199}")     # a model's file name in a folder, without .gguf


def ollama_name(stem: str) -> str:
    return stem if ":" in stem else f"{stem}:latest"


def _resolve(sup, name: str) -> Path:
    """The file an Ollama name (`smol`, `smol:latest`, a path in the library) stands for, or a 404."""
    from kiln.native.models.library import ModelNotFound, resolve_model
    from ..core.placer import _stem
    check_model_ref(sup, name)
    try:
        try:
            return resolve_model(name)
        except ModelNotFound:
            return resolve_model(_stem(name))
    except ModelNotFound as e:
        raise JSONError(404, "model_not_found", str(e)) from None


class OllamaLibrary:
    def __init__(self, sup, api):
        self.sup, self.api = sup, api

    @staticmethod
    def _only(body: dict, allowed: set[str], path: str) -> dict:
        """A 400 naming a field this route would otherwise ignore."""
        for k in body:
            if k not in allowed:
                raise bad(k, f"unsupported field {k!r} for {path} (supported: {', '.join(sorted(allowed))})",
                          "unsupported_field")
        return body

    def _name_of(self, req, *fields: str) -> str:
        body = self._only(self.api.read_json(req), set(fields), req.path)
        for f in fields:
            v = body.get(f)
            if v is not None:
                if not isinstance(v, str) or not v:
                    raise bad(f, f"{f} must be a model name")
                return v
        raise bad(fields[0], f"{fields[0]} is required")

    def on_get_tags(self, req, resp):
        out = []
        for m in bus(self.sup, "library")["models"]:
            out.append({"name": ollama_name(m["name"]), "model": ollama_name(m["name"]),
                        "modified_at": datetime.fromtimestamp(m["modified"], timezone.utc).isoformat(),
                        "size": m["size_bytes"], "digest": file_digest(m["path"], m["size_bytes"], m["modified"]),
                        "details": details(m["path"])})
        resp.media = {"models": out}

    def on_post_show(self, req, resp):
        body = self._only(self.api.read_json(req), {"model", "name", "verbose"}, req.path)
        verbose = body.get("verbose", False)
        if not isinstance(verbose, bool):
            raise bad("verbose", "verbose must be a boolean", "invalid_type")
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("model", "model is required")
        from kiln.native.gguf_file import GGUFError, read_gguf
        from kiln.native.models.inspect import fim_markers
        path = _resolve(self.sup, name)
        try:
            g = read_gguf(path)               # with the vocabulary: the FIM markers are found in it
        except GGUFError as e:
            raise JSONError(400, "model_invalid", str(e)) from None
        # verbose: the arrays too (the vocabulary, merges, …), as Ollama's
        import numpy as np
        meta = {k: (v.tolist() if isinstance(v, np.ndarray) else list(v) if isinstance(v, list) else v)
                for k, v in g.metadata.items()
                if (verbose or not isinstance(v, (list, np.ndarray))) and not isinstance(v, bytes)
                and k != "tokenizer.chat_template"}
        template = g.metadata.get("tokenizer.chat_template") or ""
        fim = fim_markers(g)
        # tools with any chat template: one that knows none gets them described (native/tool_calls.py)
        caps = ["completion"] + (["tools"] if template else []) + \
            (["thinking"] if "<think>" in template else []) + (["insert"] if fim else [])
        if fim:
            # Ollama's FIM clause, with the layout Kiln gives a `suffix`: how Ollama's clients (Continue)
            # tell that a model fills in the middle — around the model's own chat template
            pre, suf, mid = fim
            template = (f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}{{{{- else }}}}"
                        f"{template}{{{{- end }}}}")
        # the context a request gets (clients send it back as num_ctx, which Kiln refuses above it)
        params = f"num_ctx {self._context(path, g)}"
        resp.media = {"modelfile": f"FROM {path}\n", "parameters": params, "template": template,
                      "details": details(str(path)), "model_info": meta, "capabilities": caps,
                      "modified_at": datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()}

    def _context(self, path: Path, g) -> int:
        """The context the model is served with: its worker's when loaded, else what a load
        would give it (`[models] ctx`, or its plan's: the trained context, at most 4096)."""
        for m in bus(self.sup, "ps")["models"]:
            f = file_of(m.get("path") or str(m["model"]))
            if f is not None and f.resolve() == path.resolve() and m.get("n_ctx"):
                return int(m["n_ctx"])
        from kiln.native.config import read_config
        from kiln.native.gguf_file import GGUFError
        try:
            return int(self.sup.cfg["models"]["ctx"] or min(read_config(g).n_ctx_train, 4096))
        except GGUFError as e:                # its header reads, but its numbers cannot be a model
            raise JSONError(400, "model_invalid", str(e)) from None

    def on_delete_delete(self, req, resp):
        """Delete a model file from a Kiln model folder (`kiln models rm`); refused while a
        running worker uses it."""
        path = library_entry(_resolve(self.sup, self._name_of(req, "model", "name")))
        users = [w["name"] for w in bus(self.sup, "status")["workers"]
                 if w["pid"] and (w.get("stats") or {}).get("path")
                 and Path(w["stats"]["path"]).resolve() == path.resolve()]
        if users:
            raise JSONError(409, "model_in_use", f"{path.name} is in use by worker {', '.join(users)}; "
                            f"stop it first (`kiln stop {users[0]}`)")
        path.unlink()
        resp.media = {}

    def on_post_copy(self, req, resp):
        """`ollama cp SOURCE DEST`: DEST becomes another name for SOURCE's file — a hard link
        beside it (no second copy of the bytes), or a symbolic link where a hard link cannot be."""
        body = self._only(self.api.read_json(req), {"source", "destination"}, req.path)
        for f in ("source", "destination"):
            if not isinstance(body.get(f), str) or not body[f]:
                raise bad(f, f"{f} is required (a model name)")
        src = _resolve(self.sup, body["source"])
        from ..core.placer import _stem
        dest_name = _stem(body["destination"])
        if not _FILE_STEM.fullmatch(dest_name):
            raise bad("destination", f"destination {body['destination']!r} must be a plain model name")
        dest = library_entry(src).parent / f"{dest_name}.gguf"
        if dest.exists() or dest.is_symlink():
            raise JSONError(400, "model_exists", f"{dest} exists already; delete it first (DELETE /api/delete)")
        try:
            os.link(src.resolve(), dest)
        except OSError:
            os.symlink(src.resolve(), dest)
        resp.media = {}

    def on_post_create(self, req, resp):
        raise JSONError(501, "not_supported", "Kiln has no Modelfiles: it serves GGUF files as they are — put one in "
                        "a model folder or `kiln models pull hf:ORG/REPO[/FILE.gguf]`; parameters are a worker's "
                        "settings in kiln.toml")

    def on_post_push(self, req, resp):
        raise JSONError(501, "not_supported", "Kiln has no registry to push to")

    def on_post_blobs(self, req, resp, digest):
        raise JSONError(501, "not_supported", "Kiln has no blob store (it is for /api/create, which Kiln does not "
                        "have): put a GGUF file in a model folder instead")

    on_head_blobs = on_post_blobs

    def on_post_pull(self, req, resp):
        body = self._only(self.api.read_json(req), {"model", "name", "stream", "insecure"}, req.path)
        if body.get("insecure"):
            raise bad("insecure", "insecure has no meaning here: Kiln pulls over HTTPS from Hugging Face only")
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("model", "model is required")
        check_model_ref(self.sup, name)
        from kiln.native.models.library import ModelNotFound, PullError, pull_default, resolve_model
        stream = body.get("stream", True)

        def run(progress):
            try:
                return resolve_model(name)                  # already here
            except ModelNotFound:
                pass
            if name in ("default", "default:latest"):
                return pull_default(progress=lambda m: progress({"status": m}))
            from kiln.native.models.hub import pull_hf

            def bar(done, total=None, *_):
                progress({"status": "downloading", "completed": done, "total": total})
            # hf.co/ORG/REPO:QUANT and the other hub forms; an Ollama registry name says why not
            return pull_hf(name, bar, say=lambda m: progress({"status": m}))

        if not stream:
            try:
                run(lambda _: None)
            except PullError as e:
                raise JSONError(400, "bad_model", str(e)) from None
            resp.media = {"status": "success"}
            return

        def lines():
            events = []
            try:
                yield ndjson({"status": "pulling manifest"})
                run(events.append)
                for e in events:
                    yield ndjson(e)
                yield ndjson({"status": "success"})
            except PullError as e:
                yield ndjson({"error": str(e)})
        resp.content_type = "application/x-ndjson"
        resp.stream = lines()


def ndjson(obj: dict) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


def file_of(model: str):
    """The file a loaded model runs from ('default', a library name or a path), or None."""
    from kiln.native.models.library import ModelNotFound, resolve_model
    try:
        path = resolve_model(model)
        return path if path.is_file() else None
    except (ModelNotFound, OSError, ValueError):
        return None


def file_digest(path: str, size: int, mtime: float) -> str:
    """A stable id for a file version without hashing gigabytes on every list."""
    return hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()


def details(path: str) -> dict:
    from kiln.native.gguf_file import GGUFError, read_gguf
    try:
        g = read_gguf(path, skip_arrays=True)
    except (GGUFError, OSError, ValueError):
        return {"format": "gguf", "family": "", "families": [], "parameter_size": "", "quantization_level": ""}
    arch = str(g.metadata.get("general.architecture", ""))
    n = sum(t.n_elements for t in g.tensors.values())
    types = {}
    for t in g.tensors.values():
        types[t.type.name] = types.get(t.type.name, 0) + t.n_elements
    quant = max(types, key=types.get) if types else ""
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    return {"format": "gguf", "family": arch, "families": [arch], "parameter_size": size, "quantization_level": quant}


def install(app, sup, api) -> None:
    lib = OllamaLibrary(sup, api)
    for route in ("tags", "show", "pull", "delete", "copy", "create", "push"):
        app.add_route(f"/api/{route}", lib, suffix=route)
    app.add_route("/api/blobs/{digest}", lib, suffix="blobs")

