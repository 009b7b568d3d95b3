"""`kiln adapters …`: the adapter registry — list, load (make active), unload, delete, and PEFT
import/export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .engine import fail
from .train import _client, _cmd

adapters_app = typer.Typer(help="LoRA adapters: list, load (make active), unload, delete.", no_args_is_help=True)


@adapters_app.command("list")
def adapters_list(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Registered adapters; * marks the active one."""
    with _client() as c:
        r = _cmd(c, "adapters.list")
    if as_json:
        typer.echo(json.dumps(r))
        return
    if not r["adapters"]:
        typer.echo("no adapters (`kiln train sft` makes one)")
        return
    typer.echo(f"  {'NAME':<20}{'BASE':<36}{'RANK':>5}{'ALPHA':>7}{'SIZE':>9}  JOB")
    for a in r["adapters"]:
        mark = "*" if a["active"] else " "
        typer.echo(f"{mark} {a['name']:<20}{str(a.get('base_model') or '?'):<36}{a.get('rank') or '?':>5}"
                   f"{a.get('alpha') or '?':>7}{a['size_bytes'] / 2**20:>7.1f}MB  {a.get('job') or '-'}")


@adapters_app.command("load")
def adapters_load(name: str = typer.Argument(..., help="adapter name")):
    """Make NAME the active adapter (used by requests that name none)."""
    with _client() as c:
        _cmd(c, "adapters.load", {"name": name})
    typer.echo(f"adapter {name} is active")


@adapters_app.command("unload")
def adapters_unload():
    """Serve the base model again (requests may still name an adapter)."""
    with _client() as c:
        r = _cmd(c, "adapters.unload")
    typer.echo(f"adapter {r['was']} unloaded" if r["was"] else "no adapter was active")


@adapters_app.command("delete")
def adapters_delete(name: str = typer.Argument(..., help="adapter name")):
    """Delete an adapter (refused while it is active or in use)."""
    with _client() as c:
        _cmd(c, "adapters.delete", {"name": name})
    typer.echo(f"adapter {name} deleted")


def _heads(model_spec: str):
    """(arch, n_head, n_head_kv, path) of a base model, from its GGUF metadata."""
    from kiln.native.config import read_config
    from kiln.native.gguf_file import GGUFError, read_gguf
    from kiln.native.models.library import ModelNotFound, resolve_model
    try:
        path = resolve_model(model_spec)
        c = read_config(read_gguf(path, skip_arrays=True))
    except (ModelNotFound, GGUFError, ValueError) as e:
        fail(str(e))
    return c.arch, c.n_head, c.n_head_kv, path


def _registry():
    from kiln.protocol.store.adapter_registry import AdapterRegistry

    from ..core.paths import Paths
    return AdapterRegistry(Paths.from_env().home)


@adapters_app.command("import")
def adapters_import(path: str = typer.Argument(..., help="a Hugging Face PEFT LoRA folder (adapter_config.json + "
                                               "adapter_model.safetensors)"),
                    name: str = typer.Option(..., "--name", help="the adapter's name in Kiln"),
                    model: str = typer.Option("default", "--model", "-m", help="the base model it was trained on"),
                    force: bool = typer.Option(False, "--force", help="replace an adapter of that name")):
    """Import a PEFT LoRA as a GGUF LoRA (what llama.cpp loads): names mapped, q/k rows permuted as
    the GGUF converter permutes the base weights, alpha kept."""
    from kiln.native.gguf_file import read_gguf
    from kiln.native.lora import AdapterError, save_adapter
    from kiln.native.training.peft import import_peft
    from kiln.protocol.store.adapter_registry import check_name
    reg = _registry()
    try:
        check_name(name)
    except ValueError as e:
        fail(str(e))
    if name in reg.names() and not force:
        fail(f"an adapter named {name!r} exists; choose another --name or give --force")
    arch, n_head, n_head_kv, base = _heads(model)
    try:
        ad = import_peft(path, arch, n_head, n_head_kv)
        ad.check_fits(read_gguf(base, skip_arrays=True))
    except AdapterError as e:
        fail(str(e))
    save_adapter(ad, reg.gguf_path(name), name)
    reg.register(name, {"base_model": base.name, "base_path": str(base), "rank": ad.rank, "alpha": ad.alpha,
                        "targets": ad.targets, "source": f"peft:{Path(path).resolve()}"})
    typer.echo(f"imported {path} as adapter {name} (rank {ad.rank}, alpha {ad.alpha:g}, "
               f"{len(ad.tensors)} tensors, base {base.name})")


@adapters_app.command("export")
def adapters_export(name: str = typer.Argument(..., help="adapter name"),
                    peft: str = typer.Option(..., "--peft", help="folder to write the PEFT adapter into"),
                    model: Optional[str] = typer.Option(None, "--model", "-m", help="its base model (default: the "
                                                        "one recorded when it was made)")):
    """Export an adapter as a Hugging Face PEFT LoRA folder (the inverse of import)."""
    from kiln.native.lora import AdapterError, load_adapter
    from kiln.native.training.peft import export_peft
    from kiln.protocol.store.adapter_registry import AdapterNotFound
    reg = _registry()
    try:
        meta = reg.get(name)
    except (AdapterNotFound, ValueError) as e:
        fail(str(e))
    base_spec = model or meta.get("base_path") or "default"
    arch, n_head, n_head_kv, base = _heads(base_spec)
    try:
        ad = load_adapter(meta["path"])
    except AdapterError as e:
        fail(str(e))
    if ad.arch != arch:
        fail(f"adapter {name} is for {ad.arch}, {base.name} is {arch}")
    out = export_peft(ad, peft, n_head, n_head_kv, base.stem)
    typer.echo(f"wrote {out}/adapter_config.json and adapter_model.safetensors")
