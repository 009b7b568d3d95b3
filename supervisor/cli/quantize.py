"""`kiln models quantize IN OUT TYPE`: an F16/BF16/F32 model written in a quantized file type, the
bytes llama.cpp's quantizer writes (native/models/quantize.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .engine import _progress_bar, fail, model_path, models_app, note


def output_path(out: str) -> Path:
    """OUT as given when it looks like a file (a folder in it, or .gguf); a bare name goes to the
    first model folder as NAME.gguf, so that it is a library model at once."""
    from kiln.native.models.created import NAME
    from kiln.native.models.folders import model_dirs
    if "/" in out or out.endswith(".gguf"):
        return Path(out).expanduser()
    if not NAME.match(out):
        fail(f"{out!r} is neither a file path (…/NAME.gguf) nor a model name (letters, digits, '_', '.', '-')", 2)
    return model_dirs()[0] / f"{out}.gguf"


@models_app.command("quantize")
def models_quantize(source: str = typer.Argument(..., metavar="IN", help="an F16, BF16 or F32 GGUF: path or library name"),
                    out: str = typer.Argument(..., metavar="OUT",
                                              help="the file to write (…/NAME.gguf), or a name: NAME.gguf in the model folder"),
                    file_type: str = typer.Argument(..., metavar="TYPE",
                                                    help="Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_S "
                                                         "or Q5_K_S (any case)"),
                    threads: int = typer.Option(0, "--threads", "-t", help="threads (0: every core, as llama-quantize)"),
                    force: bool = typer.Option(False, "--force", help="replace OUT if it exists"),
                    as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Quantize a model: the same bytes as llama.cpp's `llama-quantize IN OUT TYPE` (no importance
    matrix) — its mixture for the _M and _S types (Q6_K for the output head and for some layers'
    value and down projections), its fallbacks for rows that K-quants cannot hold. The file is
    written under a temporary name and appears whole, with a manifest (`kiln models verify`)."""
    from kiln.native.models.quant_types import FILE_TYPES, QuantizeError
    from kiln.native.models.quantize import quantize_model
    if file_type.upper() not in FILE_TYPES:
        fail(f"{file_type!r} is not a file type Kiln writes; choose one of {', '.join(FILE_TYPES)}", 2)
    src = model_path(source)
    dst = output_path(out)
    bar = _progress_bar()
    note(f"kiln: quantizing {src.name} to {file_type.upper()} -> {dst}")
    try:
        r = quantize_model(src, dst, file_type, threads=threads, force=force, progress=lambda d, t, _: bar(d, t))
    except QuantizeError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; nothing was written", 130)
    if as_json:
        typer.echo(json.dumps(r))
        return
    mix = ", ".join(f"{n} {k}" for k, n in sorted(r["types"].items(), key=lambda kv: -kv[1]))
    typer.echo(f"wrote {r['output']} ({r['file_type']}: {r['bytes_out'] / 2**20:,.1f} MiB from "
               f"{r['bytes_in'] / 2**20:,.1f} MiB in {r['seconds']:.1f} s; tensors: {mix})")
    if r["fallbacks"]:
        note(f"kiln: {len(r['fallbacks'])} tensor(s) cannot hold their type's blocks and use another, as llama.cpp "
             f"does: " + "; ".join(f"{f['tensor']} {f['wanted']}->{f['used']}" for f in r["fallbacks"][:6])
             + (" …" if len(r["fallbacks"]) > 6 else ""))
