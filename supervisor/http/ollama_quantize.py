"""Ollama's `/api/create` with `quantize`: the base model (F16, BF16 or F32) written in the asked
file type into the first model folder — the bytes llama.cpp's quantizer writes — and the new name
made to stand for it: the file itself when the body asks nothing else, else a created model's
manifest (its system prompt, parameters, messages, adapter) over the quantized file."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from .common import JSONError, ndjson
from .openai_validate import bad

ONLY_FROM = ("system", "parameters", "messages", "adapter", "license")


class Cancelled(Exception):
    """The client went away: the quantization stops and leaves no file."""


def target(spec: dict, base: str, quant: str) -> Path:
    """Where the quantized file goes: NAME.gguf when the name is the file, NAME-QUANT.gguf under a
    created model's manifest; a 400 if that file exists already."""
    from kiln.native.models.folders import model_dirs
    from kiln.native.models import created
    extras = any(spec.get(k) for k in ONLY_FROM)
    if not extras and created.load(base) is not None:
        raise JSONError(400, "model_exists", f"{base!r} is a created model already; delete it first (DELETE /api/delete) "
                        f"or give the quantized model another name")
    path = model_dirs()[0] / (f"{base}-{quant.lower()}.gguf" if extras else f"{base}.gguf")
    if path.exists():
        raise JSONError(400, "model_exists", f"{path} exists already; delete it first (DELETE /api/delete)")
    return path


def check_type(quant) -> str:
    from kiln.native.models.quant_types import FILE_TYPES
    if not isinstance(quant, str) or quant.upper() not in FILE_TYPES:
        raise bad("quantize", f"quantize {quant!r} is not a type Kiln writes; one of {', '.join(FILE_TYPES)} (any case)")
    return quant.upper()


def run(src: Path, dst: Path, quant: str, events: queue.Queue | None, cancel: threading.Event) -> dict:
    """Quantize, reporting progress on `events` (Ollama's status lines) until `cancel` is set."""
    from kiln.native.models.quantize import quantize_model
    status = f"quantizing {src.name} to {quant}"
    last = [-1]

    def progress(done: int, total: int, _tensor: str) -> None:
        if cancel.is_set():
            raise Cancelled()
        pct = done * 100 // max(total, 1)
        if events is not None and pct != last[0]:
            last[0] = pct
            events.put({"status": status, "total": total, "completed": done})
    return quantize_model(src, dst, quant, progress=progress)


def stream(src: Path, dst: Path, quant: str, finish):
    """NDJSON lines while a thread quantizes; `finish()` (the manifest, if any) after it; the work
    cancelled when the client stops reading."""
    from kiln.native.models.quant_types import QuantizeError

    events: queue.Queue = queue.Queue()
    cancel = threading.Event()
    outcome: dict = {}

    def work():
        try:
            outcome["result"] = run(src, dst, quant, events, cancel)
        except (QuantizeError, Cancelled, OSError) as e:
            outcome["error"] = str(e) or "cancelled"
        finally:
            events.put(None)
    threading.Thread(target=work, name="kiln-quantize", daemon=True).start()
    try:
        while (e := events.get()) is not None:
            yield ndjson(e)
        if "error" in outcome:
            yield ndjson({"error": outcome["error"]})
            return
        for line in finish():
            yield ndjson(line)
    finally:
        cancel.set()


def create_quantized(body: dict, resp, spec: dict, base: str, src: Path) -> None:
    """`quantize` given to /api/create: the base checked (a 400 before any line is streamed), written
    in that type, then the name made to stand for it."""
    from kiln.native.models import created
    from kiln.native.models.quant_types import QuantizeError
    from kiln.native.models.quantize import plan
    quant = check_type(body["quantize"])
    try:
        plan(src, quant)
    except QuantizeError as e:
        raise bad("from", f"cannot quantize {src.name}: {e}") from None
    dst = target(spec, base, quant)
    extras = any(spec.get(k) for k in ONLY_FROM)

    def finish():
        if extras:
            created.save(base, {**spec, "from": str(dst)}, dst)
        return [{"status": "writing manifest"}, {"status": "success"}]
    if body.get("stream", True):
        resp.content_type = "application/x-ndjson"
        resp.stream = stream(src, dst, quant, finish)
        return
    try:
        run(src, dst, quant, None, threading.Event())
    except QuantizeError as e:
        raise bad("from", str(e)) from None
    finish()
    resp.media = {"status": "success"}
