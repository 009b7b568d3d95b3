"""Ollama's model-library routes on Kiln's port: /api/tags, show, pull, delete, copy — the
GGUF files in Kiln's model folders under Ollama's names (`name:latest`) — and the shapes they
share with the generation routes (supervisor/ollama_api.py) — and /api/create: a model over a base
one with its own system prompt, parameters and adapter (native/models/created.py). Push and blobs
answer 501 with what Kiln does instead: there is no Ollama registry here."""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path

from .common import JSONError, bus, ndjson, served_file
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
    for w in bus(sup, "status")["workers"]:          # a served model, by its worker's name (/api/ps)
        if w["name"] == name and served_file(w):
            return Path(served_file(w))
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
            if m.get("from"):                 # a created model: the base's file and details
                out.append({"name": ollama_name(m["name"]), "model": ollama_name(m["name"]),
                            "modified_at": datetime.fromtimestamp(m["modified"], timezone.utc).isoformat(),
                            "size": m["size_bytes"], "digest": m["digest"], "details": details(m["path"])})
                continue
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
        from kiln.native.models.inspect import capabilities, fim_markers
        from kiln.native.models import created
        record = created.load(name)
        path = Path(record["path"]) if record else _resolve(self.sup, name)
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
        caps = capabilities(g)
        if fim:
            # Ollama's FIM clause, with the layout Kiln gives a `suffix`: how Ollama's clients (Continue)
            # tell that a model fills in the middle — around the model's own chat template
            pre, suf, mid = fim
            template = (f"{{{{- if .Suffix }}}}{pre}{{{{ .Prompt }}}}{suf}{{{{ .Suffix }}}}{mid}{{{{- else }}}}"
                        f"{template}{{{{- end }}}}")
        # the context a request gets (clients send it back as num_ctx, which Kiln refuses above it)
        params = f"num_ctx {self._context(path, g)}"
        extra = {}
        if record:                            # a created model: its Modelfile, system prompt and parameters
            names = {v: k for k, v in created.PARAMETERS.items()}
            params = "\n".join([f"{names[k]} {json.dumps(x)}" for k, v in record["parameters"].items()
                                for x in (v if isinstance(v, list) else [v])] + [params])
            extra = {"system": record.get("system") or "", "license": record.get("license") or "",
                     "messages": record.get("messages") or []}
        resp.media = {**extra, "modelfile": created.to_modelfile(record) if record else f"FROM {path}\n",
                      "parameters": params, "template": template,
                      "details": details(str(path)), "model_info": meta, "capabilities": caps,
                      "modified_at": datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()}

    def _context(self, path: Path, g) -> int:
        """The context the model is served with: its worker's when loaded, else what a load
        would give it (`[models] ctx`, or its plan's: sized by the model memory budget)."""
        for m in bus(self.sup, "ps")["models"]:
            f = file_of(m.get("path") or str(m["model"]))
            if f is not None and f.resolve() == path.resolve() and m.get("n_ctx"):
                return int(m["n_ctx"])
        if self.sup.cfg["models"]["ctx"]:
            return int(self.sup.cfg["models"]["ctx"])
        try:
            return int(bus(self.sup, "plan", {"model": str(path)})["context"])   # sized as a load would size it
        except JSONError as e:                # its header reads, but its numbers cannot be a model
            raise JSONError(400, "model_invalid", e.kiln_body["error"]["message"]) from None

    def on_delete_delete(self, req, resp):
        """Delete a model file from a Kiln model folder (`kiln models rm`); refused while a
        running worker uses it."""
        from kiln.native.models import created
        name = self._name_of(req, "model", "name")
        if created.delete(name):              # a created model: its manifest only, never the base file
            resp.media = {}
            return
        path = library_entry(_resolve(self.sup, name))
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
        from kiln.native.models import created
        record = created.load(body["source"])
        if record is not None:                # a created model: a second manifest over the same base
            try:
                dest = created.plain_name(body["destination"])
            except created.ModelfileError as e:
                raise bad("destination", str(e)) from None
            if created.load(dest) is not None:
                raise JSONError(400, "model_exists", f"{dest!r} exists already; delete it first (DELETE /api/delete)")
            created.save(dest, {k: v for k, v in record.items() if k not in ("name", "path", "created_at")},
                         Path(record["path"]))
            resp.media = {}
            return
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
        """A model over a base one with its own system prompt, parameters, messages and adapter
        (Ollama's create body, or a Modelfile's text in `modelfile`): a manifest, no copy."""
        body = self._only(self.api.read_json(req), {"model", "name", "from", "system", "parameters", "messages",
                                                   "adapters", "license", "modelfile", "stream", "template",
                                                   "quantize", "files"}, req.path)
        from kiln.native.models import created
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad("model", "model is required (the new model's name)")
        for k, why in (("template", "Kiln renders the model's own chat template (Jinja, from the GGUF) and cannot run "
                                    "Ollama's Go templates"),
                       ("files", "Kiln has no blob store: name the base model in `from`")):
            if body.get(k):
                raise bad(k, f"{k} is not supported: {why}")
        try:
            spec = self._create_spec(body)
            base = created.plain_name(name)
        except created.ModelfileError as e:
            raise bad("modelfile" if body.get("modelfile") else "from", str(e)) from None
        existing = created.load(base)
        try:
            path = _resolve(self.sup, spec["from"])
        except JSONError:
            raise JSONError(400, "model_not_found", f"from {spec['from']!r}: no such model here (GET /api/tags; "
                            f"`kiln models pull` fetches one)") from None
        if existing is None:
            try:
                _resolve(self.sup, base)
                raise JSONError(400, "model_exists", f"{base!r} is a model file already; choose another name")
            except JSONError as e:
                if e.kiln_body["error"]["code"] == "model_exists":
                    raise
        if spec.get("adapter"):
            from kiln.native.models.library import sha256_file
            from kiln.protocol.store.adapter_registry import AdapterNotFound, AdapterRegistry
            try:
                meta = AdapterRegistry(self.sup.paths.home).get(spec["adapter"])
            except (AdapterNotFound, ValueError) as e:
                raise bad("adapters", f"adapter {spec['adapter']!r}: {e}; register it first (`kiln adapters import`)") \
                    from None
            digest = (body.get("adapters") or {}).get(spec["adapter"]) or ""
            if digest and digest.removeprefix("sha256:") != sha256_file(Path(meta["path"])):
                raise bad("adapters", f"adapter {spec['adapter']!r} is not the file of digest {digest[:80]!r}")
        if body.get("quantize"):
            from .ollama_quantize import create_quantized
            return create_quantized(body, resp, spec, base, path)
        created.save(base, spec, path)
        if body.get("stream", True):
            resp.content_type = "application/x-ndjson"
            resp.text = "".join(ndjson(x).decode() for x in ({"status": f"using {path.name}"},
                                                              {"status": "writing manifest"}, {"status": "success"}))
        else:
            resp.media = {"status": "success"}

    @staticmethod
    def _create_spec(body: dict) -> dict:
        """The spec of a create body: a Modelfile's text, or Ollama's fields (not both)."""
        from kiln.native.models import created
        from kiln.protocol.sampling import out_of_bounds
        if body.get("modelfile"):
            if not isinstance(body["modelfile"], str):
                raise bad("modelfile", "modelfile must be a string", "invalid_type")
            if any(body.get(k) for k in ("from", "system", "parameters", "messages", "adapters", "license")):
                raise bad("modelfile", "give a modelfile or the fields (from, system, …), not both")
            return created.parse_modelfile(body["modelfile"], out_of_bounds)
        if not isinstance(body.get("from"), str) or not body["from"]:
            raise bad("from", "from is required: the model this one builds on")
        lines = [f"FROM {body['from']}"]
        params = body.get("parameters") or {}
        if not isinstance(params, dict):
            raise bad("parameters", "parameters must be an object", "invalid_type")
        for k, v in params.items():
            for one in (v if isinstance(v, list) else [v]):
                lines.append(f"PARAMETER {k} {json.dumps(one)}")
        spec = created.parse_modelfile("\n".join(lines), out_of_bounds)
        if isinstance(body.get("license"), list) and all(isinstance(x, str) for x in body["license"]):
            body = {**body, "license": "\n\n".join(body["license"])}       # the client sends several as a list
        for k in ("system", "license"):
            if body.get(k) is not None:
                if not isinstance(body[k], str):
                    raise bad(k, f"{k} must be a string", "invalid_type")
                spec[k] = body[k]
        msgs = body.get("messages") or []
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and m.get("role") in created.ROLES
                                                 and isinstance(m.get("content"), str) for m in msgs):
            raise bad("messages", "messages must be a list of {role: system|user|assistant, content: string}")
        spec["messages"] = [{"role": m["role"], "content": m["content"]} for m in msgs]
        adapters = body.get("adapters") or {}
        if not isinstance(adapters, dict) or len(adapters) > 1:
            raise bad("adapters", "adapters must be an object naming one registered adapter (`kiln adapters list`)")
        if adapters:
            spec["adapter"] = next(iter(adapters))
        return spec

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

