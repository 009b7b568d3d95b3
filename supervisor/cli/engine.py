"""`kiln models …`: commands that read model files in the CLI process — and the helpers every
command that loads a model here shares (cli/debug.py's too)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

models_app = typer.Typer(help="Find, inspect and fetch GGUF models.", no_args_is_help=True)


def verbosity() -> int:
    """-1 (kiln -q), 0, 1 (-v) or 2 (-vv): the root options, kept in KILN_VERBOSITY so that a
    detached daemon and the commands it runs inherit them."""
    try:
        return max(-1, min(2, int(os.environ.get("KILN_VERBOSITY", "0"))))
    except ValueError:
        return 0


def note(message: str) -> None:
    """Something worth knowing on stderr that is not the command's result: silent with -q."""
    if verbosity() >= 0:
        typer.echo(message, err=True)


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"kiln: {message}", err=True)
    raise typer.Exit(code)


def model_path(spec: str):
    from kiln.native.models.library import ModelNotFound, PullError, resolve_model
    try:
        return resolve_model(spec, pull=(spec == "default"),
                             progress=lambda m: note(f"kiln: {m}"))
    except (ModelNotFound, PullError) as e:
        fail(str(e))


def load_or_exit(spec: str):
    from kiln.native.gguf_file import GGUFError
    from kiln.native.model import load_model
    from kiln.native.tokenizer import TokenizerError
    path = model_path(spec)
    try:
        return load_model(path)
    except (GGUFError, TokenizerError) as e:
        fail(str(e))


def emit(obj, as_json: bool, human) -> None:
    if as_json:
        typer.echo(json.dumps(obj, ensure_ascii=False))
    else:
        human(obj)


# -- models ------------------------------------------------------------------------------------

@models_app.command("inspect")
def models_inspect(model: str = typer.Argument(..., help="path, name in a model folder, or 'default'"),
                   as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
                   tensors: bool = typer.Option(False, "--tensors", help="list every tensor"),
                   ctx: Optional[int] = typer.Option(None, "--ctx", help="context size for the KV-cache estimate")):
    """Architecture, parameters, tensor types, context, tokenizer, and the memory the engine needs."""
    from kiln.native.gguf_file import GGUFError
    from kiln.native.models.inspect import inspect_model
    path = model_path(model)
    try:
        info = inspect_model(path, tensors=tensors, ctx=ctx)
    except GGUFError as e:
        fail(str(e))

    def human(i):
        mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
        typer.echo(f"{i['name']}  ({i['path']})")
        typer.echo(f"  architecture   {i['architecture']}, {i['layers']} layers, embedding {i['embedding']}, "
                   f"{i['heads']} heads / {i['kv_heads']} KV heads")
        fam = dict(i.get("family") or {})
        if fam:
            facts = "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in fam.items() if k not in ("name", "needs"))
            typer.echo(f"  family         {fam['name']}: {fam['needs']}" + (f"\n                 {facts}" if facts else ""))
        typer.echo(f"  parameters     {i['parameters']:,}")
        typer.echo(f"  file           {mib(i['file_bytes'])}; tensor types "
                   + ", ".join(f"{k}×{v}" for k, v in i["tensor_types"].items()))
        if len(i["parts"]) > 1:
            typer.echo(f"  split          {len(i['parts'])} parts: "
                       + ", ".join(f"{Path(p['path']).name} ({mib(p['bytes'])})" for p in i["parts"]))
        typer.echo(f"  context        {i['context_length']:,} tokens (trained)")
        t = i["tokenizer"]
        typer.echo(f"  tokenizer      {t['model']} / {t['pre']}, {t['tokens']:,} tokens; chat template: "
                   f"{'yes' if i['chat_template'] else 'no'}; fill-in-the-middle: "
                   f"{'yes' if i['fill_in_the_middle'] else 'no'}")
        if i["moe"]:
            typer.echo(f"  experts        {i['moe']['experts_used']} of {i['moe']['experts']} "
                       f"({mib(i['moe']['expert_bytes'])} of expert weights)")
        m = i["memory"]
        typer.echo(f"  memory         {mib(m['total_bytes'])} = weights {mib(m['weights_bytes'])} "
                   f"({i['kernel_path']} path) + KV cache {mib(m['kv_cache_bytes'])} at {m['context']:,} tokens")
        if i["unsupported_tensor_types"]:
            typer.echo(f"  UNSUPPORTED    tensor types {', '.join(i['unsupported_tensor_types'])}")
        for t in i.get("tensors", []):
            typer.echo(f"    {t['name']:<40} {t['type']:<6} {str(t['shape']):<20} {t['bytes']:>12,}")
    emit(info, as_json, human)


@models_app.command("list")
def models_list(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """GGUF models in the model folders, the Hugging Face cache, Ollama's store and Python packages."""
    from kiln.native.models.discovery import as_dicts, discover
    entries = as_dicts(discover())
    if as_json:
        typer.echo(json.dumps(entries))
        return
    if not entries:
        typer.echo("no models found; `kiln models pull default` fetches one")
        return
    typer.echo(f"{'NAME':<44}{'SOURCE':<10}{'ARCH':<10}{'PARAMS':>8}{'QUANT':>8}{'SIZE':>10}{'CTX':>7}")
    for e in entries:
        if e["error"]:
            typer.echo(f"{e['name']:<44}{e['source']:<10}UNREADABLE: {e['error']}  ({e['path']})")
            continue
        params = f"{e['parameters'] / 1e6:.0f}M" if e["parameters"] < 1e9 else f"{e['parameters'] / 1e9:.1f}B"
        typer.echo(f"{e['name']:<44}{e['source']:<10}{e['architecture']:<10}{params:>8}{e['quantization']:>8}"
                   f"{e['file_bytes'] / 2**20:>8.0f}MB{e['context_length'] or '-':>7}")


@models_app.command("plan")
def models_plan(model: str = typer.Argument(..., help="path, name, or 'default'"),
                ctx: Optional[int] = typer.Option(None, "--ctx", help="context size to plan for"),
                parallel: Optional[int] = typer.Option(None, "--parallel", help="sequences decoded together, each "
                                                       "with its own KV cache (a worker's `parallel`; default 4)"),
                draft: Optional[str] = typer.Option(None, "--draft", help="a draft model served beside it "
                                                    "(a worker's `draft_model`): its weights and KV caches count too"),
                stream: bool = typer.Option(False, "--stream", help="also measure which expert-cache size streams "
                                            "this MoE fastest here (kept for --expert-cache auto)"),
                tokens: int = typer.Option(32, "--tokens", help="with --stream: decode steps measured per cache size"),
                kv_type: str = typer.Option("f16", "--kv-type", help="the KV cache's type: f16, q8_0 or q4_0 "
                                            "(a worker's kv_type)"),
                as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Will it run here? Weights, KV cache and runtime against available RAM: fits / streams / too_large."""
    from kiln.native.gguf_file import GGUFError
    from kiln.native.models.plan import plan
    path = model_path(model)
    try:
        p = plan(path, ctx, parallel=parallel, draft=model_path(draft) if draft else None, kv=(kv_type, kv_type))
    except (GGUFError, ValueError) as e:
        fail(str(e))
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    if stream:
        from kiln.native.models.tune import save_tuned, tune
        from ..core.paths import Paths
        say = (lambda m: None) if as_json else (lambda m: note(f"  measuring: {m}"))
        try:
            p["expert_cache_tuning"] = t = tune(path, tokens=tokens, progress=say)
        except (GGUFError, ValueError) as e:
            fail(str(e))
        save_tuned(Paths.from_env().home, path, t)

    def human(p):
        typer.echo(f"{p['verdict']}: weights {gib(p['weights_bytes'])} ({p['kernel_path']} path) + KV cache "
                   f"{gib(p['kv_cache_bytes'])} ({p['parallel']} × {p['context']} tokens, {'/'.join(dict.fromkeys(p['kv_types']))})"
                   + (f" + draft model {gib(p['draft_weights_bytes'] + p['draft_kv_cache_bytes'])}" if 'draft_model' in p else "")
                   + f" + runtime {gib(p['runtime_bytes'])} = "
                   f"{gib(p['total_bytes'])}; available {gib(p['available_bytes'])}\n  {p['advice']}")
        t = p.get("expert_cache_tuning")
        if t:
            for r in t["runs"]:
                typer.echo(f"  expert cache {r['fraction']:>4.0%} {gib(r['cache_bytes']):>10}  "
                           + (f"{r['tok_s']:>7.2f} tok/s  hit rate {r['hit_rate']}" if "tok_s" in r else r["skipped"]))
            typer.echo(f"  suggested: --expert-cache {t['suggested_bytes'] // 2**20}MiB ({t['rule']}); "
                       f"`kiln up --model {model} --stream --expert-cache auto` uses it")
    emit(p, as_json, human)
    if p["verdict"] == "too_large":
        raise typer.Exit(1)


@models_app.command("rm")
def models_rm(model: str = typer.Argument(..., help="name or path of a model in a Kiln model folder"),
              yes: bool = typer.Option(False, "--yes", "-y", help="do not ask")):
    """Delete a model from a Kiln model folder (refused while a running worker uses it), or a
    model made with `kiln models create` (its manifest only: the base stays)."""
    from kiln.native.models import created
    from kiln.native.models.library import model_dirs
    if created.load(model) is not None:
        created.delete(model)
        typer.echo(f"deleted {created.plain_name(model)} (its base model stays)")
        return
    path = model_path(model).resolve()
    if not any(d.resolve() in path.parents for d in model_dirs() if d.exists()):
        fail(f"{path} is not in a Kiln model folder; remove it with the tool that put it there")
    from ..bus.client import ControlClient, DaemonNotRunning
    from ..core.paths import Paths
    try:
        with ControlClient(Paths.from_env(), 5) as c:
            users = [w["name"] for w in c.command("status")["workers"]
                     if w["pid"] and (w["stats"] or {}).get("path") and Path((w["stats"] or {})["path"]).resolve() == path]
    except DaemonNotRunning:
        users = []
    if users:
        fail(f"{path.name} is in use by worker {', '.join(users)}; stop it first (`kiln stop {users[0]}`)")
    if not yes and not typer.confirm(f"delete {path} ({path.stat().st_size / 2**20:.0f} MiB)?"):
        raise typer.Exit(1)
    path.unlink()
    typer.echo(f"deleted {path}")


@models_app.command("verify")
def models_verify(model: Optional[str] = typer.Argument(None, help="path, name in a model folder, or 'default'"),
                  all_: bool = typer.Option(False, "--all", help="every model in the library"),
                  as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Check a model against the manifest its pull recorded (sha256 of the file and of each 64 MiB
    chunk). Exit 0: intact; 1: it differs (the first bad byte range is shown); 2: no manifest
    (the file is hashed and reported unverified)."""
    from kiln.native.models.integrity import verify
    from kiln.native.models.library import library_files
    if all_ == bool(model):
        fail("give a MODEL or --all", 2)
    paths = library_files() if all_ else [model_path(model)]
    results = [verify(p) for p in paths]
    if as_json:
        typer.echo(json.dumps(results if all_ else results[0], indent=2))
    else:
        for r in results:
            if r["status"] == "ok":
                typer.echo(f"ok          {r['model']}  sha256 {r['sha256'][:16]}…  ({r.get('source')})")
            elif r["status"] == "mismatch":
                a, b = r["first_bad_range"]
                typer.echo(f"MISMATCH    {r['model']}: sha256 {r['sha256'][:16]}… but the manifest says "
                           f"{(r['expected_sha256'] or '')[:16]}…; first difference in bytes {a:,}–{b:,}; pull it again")
            else:
                typer.echo(f"unverified  {r['model']}: {r['reason']} (sha256 {r['sha256']})")
    if any(r["status"] == "mismatch" for r in results):
        raise typer.Exit(1)
    if any(r["status"] == "unverified" for r in results):
        raise typer.Exit(2)


def _workers_using(match) -> list[str]:
    """Running workers whose model file satisfies `match(resolved path)`."""
    from ..bus.client import ControlClient, DaemonNotRunning
    from ..core.paths import Paths
    try:
        with ControlClient(Paths.from_env(), 5) as c:
            return [w["name"] for w in c.command("status")["workers"]
                    if w["pid"] and (w["stats"] or {}).get("path") and match(Path((w["stats"] or {})["path"]).resolve())]
    except DaemonNotRunning:
        return []


def _progress_bar():
    """A progress line on stderr, updated at most ten times a second (none with -q)."""
    last = [0.0]

    def show(done: int, total: int) -> None:
        import time
        if verbosity() < 0:
            return
        now = time.monotonic()
        if now - last[0] < 0.1 and done < total:
            return
        last[0] = now
        width = 30
        filled = int(width * done / total) if total else width
        sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done / 2**20:,.1f} of "
                         f"{total / 2**20:,.1f} MiB ({100 * done / max(total, 1):.0f}%)")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


@models_app.command("create")
def models_create(name: str = typer.Argument(..., help="the new model's name"),
                  file: Path = typer.Option(..., "--file", "-f", help="the Modelfile (FROM, PARAMETER, SYSTEM, ADAPTER, "
                                                                      "MESSAGE, LICENSE)")):
    """Make a model from a Modelfile, as `ollama create`: a manifest over its base model (no copy)
    with its own system prompt, sampling defaults, adapter and opening messages, applied under a
    request's own fields. Named in any request or command like a library model."""
    from kiln.native.models import created
    from kiln.native.models.library import ModelNotFound, resolve_model
    from kiln.protocol.sampling import out_of_bounds
    from kiln.protocol.store.adapter_registry import AdapterNotFound, AdapterRegistry
    try:
        spec = created.parse_modelfile(file.read_text(encoding="utf-8"), out_of_bounds)
        base = created.plain_name(name)
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {file}: {e}")
    except created.ModelfileError as e:
        fail(f"{file}: {e}")
    try:
        path = resolve_model(spec["from"])
    except ModelNotFound as e:
        fail(f"{file}: FROM {spec['from']}: {e}")
    if created.load(base) is None:
        try:
            resolve_model(base)
            fail(f"{base!r} is a model file already; choose another name")
        except ModelNotFound:
            pass
    if spec.get("adapter"):
        from ..core.paths import Paths
        try:
            AdapterRegistry(Paths.from_env().home).get(spec["adapter"])
        except (AdapterNotFound, ValueError) as e:
            fail(f"{file}: ADAPTER {spec['adapter']}: {e}")
    created.save(base, spec, path)
    typer.echo(f"created {base} (from {path.name})")


@models_app.command("show")
def models_show(name: str = typer.Argument(..., help="a model made with `kiln models create`"),
                modelfile: bool = typer.Option(False, "--modelfile", help="print it as a Modelfile")):
    """What a created model adds to its base: system prompt, parameters, adapter, messages."""
    from kiln.native.models import created
    record = created.load(name)
    if record is None:
        fail(f"no created model named {name!r} (`kiln models list` shows them; `kiln models inspect` reads a file)")
    if modelfile:
        typer.echo(created.to_modelfile(record), nl=False)
        return
    typer.echo(json.dumps({k: v for k, v in record.items() if k != "created_at"}, indent=1, ensure_ascii=False))


@models_app.command("pull")
def models_pull(model: str = typer.Argument("default", help="'default' (SmolLM2-135M-Instruct), or a Hugging Face model: "
                                                           "hf.co/ORG/REPO[:QUANT], ORG/REPO[:QUANT], hf:ORG/REPO[/FILE.gguf][@REV]"),
                force: bool = typer.Option(False, "--force", help="download even if the file is larger than the RAM available")):
    """Download a model (verified by sha256; an interrupted pull resumes when run again). QUANT picks
    the file as llama-server's -hf does (case-insensitive; Q4_K_M when none is given, else Q8_0, else
    the first); a split model comes with all its parts, a vision model with its projector. A file
    that cannot run here (larger than the RAM available) is refused before downloading."""
    from kiln.native.models.hub_refs import parse_ref, registry_refusal
    from kiln.native.models.library import DEFAULT, PullError, model_dirs, pull_default
    ref = None if model == "default" else parse_ref(model)
    if model != "default" and ref is None:
        fail(registry_refusal(model) or f"cannot pull {model!r}: give 'default', hf.co/ORG/REPO[:QUANT], "
                                        f"ORG/REPO[:QUANT] or hf:ORG/REPO[/FILE.gguf][@REV]")
    if ref is None:
        target = (model_dirs()[0] / DEFAULT.file).resolve()
        users = _workers_using(lambda p: p == target)
    else:
        users = _workers_using(lambda p: ("models--" + ref.repo.replace("/", "--")) in str(p))
    if users:
        fail(f"{model} is open in worker {', '.join(users)}; a re-pull would replace the file under it — "
             f"stop it first (`kiln stop {users[0]}`)")
    try:
        if ref is None:
            path = pull_default(progress=lambda m: note(f"kiln: {m}"))
        else:
            import psutil

            from kiln.native.models.hub import _hub_cache, check_room, pull_hf
            from ..core.config import ConfigError, load_config
            try:
                budget = load_config(None)["supervisor"]["memory_budget"]
            except ConfigError:
                budget = 0
            avail = budget or psutil.virtual_memory().available
            path = pull_hf(model, _progress_bar(), room=lambda name, size: check_room(name, size, _hub_cache(), avail, force),
                           say=lambda m: note(f"kiln: {m}"))
    except PullError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; the partial download is kept — run the same pull again to resume", 130)
    typer.echo(str(path))
