"""`kiln train hf …`: the handoff to a GPU machine with Transformers + TRL + PEFT (issue 42) —
export a checked bundle, verify one, list and delete them, and import the adapter it comes back
with (protocol/store/hf_bundles.py holds the format and its checks)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from .engine import fail

hf_app = typer.Typer(help="Hand training to a GPU machine (Transformers + TRL + PEFT) and bring the adapter back.",
                     no_args_is_help=True)
DEFAULT_HF_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"      # the default model's Transformers repo


def _bundles():
    from kiln.protocol.store.hf_bundles import Bundles

    from ..core.paths import Paths
    return Bundles(Paths.from_env().home)


def _hf_model(model: str, given: Optional[str]) -> str:
    """The Transformers repo the GPU machine loads: given, or recorded in the GGUF's metadata."""
    if given:
        return given
    if model == "default":
        return DEFAULT_HF_MODEL
    from kiln.native.gguf_file import read_gguf
    from kiln.native.models.library import ModelNotFound, resolve_model
    try:
        path = resolve_model(model)
    except ModelNotFound as e:
        fail(str(e))
    meta = read_gguf(path, skip_arrays=True).metadata
    for key in ("general.base_model.0.repo_url", "general.source.repo_url", "general.source.url"):
        url = str(meta.get(key) or "")
        if "huggingface.co/" in url:
            return url.split("huggingface.co/", 1)[1].strip("/")
    fail(f"{path.name} does not say which Transformers model it was made from: name it with --hf-model ORG/NAME")


def _folder(bundle: str) -> Path:
    """A bundle by name (KILN_HOME/hf), or a folder."""
    p = Path(bundle)
    if p.is_dir():
        return p
    from kiln.protocol.store.hf_bundles import BundleError
    try:
        p = _bundles().path(bundle)
    except BundleError as e:
        fail(str(e))
    if not p.is_dir():
        fail(f"no bundle named {bundle!r} and no such folder (kiln train hf list)")
    return p


@hf_app.command("export-sft")
def export_sft(file: Path = typer.Option(..., "--file", "-f", help='JSONL: one {"messages": [...]} conversation per line'),
               name: str = typer.Option(..., "--name", help="the bundle's name (KILN_HOME/hf/NAME)"),
               model: str = typer.Option("default", "--model", "-m", help="the library model it is for"),
               hf_model: Optional[str] = typer.Option(None, "--hf-model", help="its Transformers repo (default: "
                                                      "from the GGUF's metadata)"),
               epochs: int = typer.Option(1, "--epochs", min=1, max=100, help="passes over the data"),
               lr: float = typer.Option(2e-4, "--lr", help="peak learning rate"),
               rank: int = typer.Option(16, "--rank", min=1, max=512, help="LoRA rank"),
               alpha: float = typer.Option(32.0, "--alpha", help="LoRA alpha"),
               seed: int = typer.Option(0, "--seed", help="the trainer's seed")):
    """Write a bundle for LoRA SFT on a GPU machine: the conversations as canonical JSONL (every line
    checked first), train_trl.py, and a manifest with the sha256 of every byte."""
    from kiln.native.data_file import DataFileError, read_data_file
    from kiln.native.training.sft_data import _check_messages
    from kiln.protocol.store.hf_bundles import canonical_jsonl

    from .hf_script import SFT_SCRIPT
    try:
        raw = read_data_file(file)
    except DataFileError as e:
        fail(str(e))
    rows, problems = [], []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            problems.append(f"line {n}: not valid JSON ({e})")
            continue
        why = _check_messages(obj)
        if why:
            problems.append(f"line {n}: {why}")
            continue
        rows.append({"messages": [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]})
    if problems or not rows:
        fail(f"{file}: " + ("; ".join(problems[:10]) if problems else "no conversations") + "; nothing was written")
    repo = _hf_model(model, hf_model)
    folder = _write(name, {"dataset.jsonl": canonical_jsonl(rows), "train_trl.py": SFT_SCRIPT.encode()},
                    {"kind": "sft", "hf_model": repo, "model": model, "rows": len(rows),
                     "options": {"epochs": epochs, "lr": lr, "rank": rank, "alpha": alpha, "seed": seed}})
    typer.echo(f"wrote {folder}: {len(rows)} conversations for {repo}; on the GPU machine: python train_trl.py, "
               f"then `kiln train hf import-peft --bundle {name} --name ADAPTER`")


def _write(name: str, files: dict, meta: dict):
    from kiln.protocol.store.hf_bundles import BundleError, write_bundle
    meta = {**meta, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        folder = _bundles().path(name)
        folder.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_bundle(folder, files, meta)
    except BundleError as e:
        fail(str(e))
    return folder


@hf_app.command("export-grpo")
def export_grpo(suite: Path = typer.Option(..., "--suite", "-s", help="an evaluation suite (JSON, as `kiln eval "
                                           "run` takes): its prompts, and each example's scorer as the reward"),
                name: str = typer.Option(..., "--name", help="the bundle's name (KILN_HOME/hf/NAME)"),
                model: str = typer.Option("default", "--model", "-m", help="the library model it is for"),
                hf_model: Optional[str] = typer.Option(None, "--hf-model", help="its Transformers repo (default: "
                                                       "from the GGUF's metadata)"),
                num_generations: int = typer.Option(4, "--num-generations", min=2, max=64,
                                                    help="completions TRL samples per prompt (a group)"),
                max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, max=32768,
                                                   help="longest sampled completion"),
                temperature: float = typer.Option(1.0, "--temperature", min=0.05, max=4.0, help="sampling temperature"),
                beta: float = typer.Option(0.04, "--beta", min=0.0, max=100.0, help="KL penalty to the base model"),
                epochs: int = typer.Option(1, "--epochs", min=1, max=100, help="passes over the prompts"),
                lr: float = typer.Option(1e-5, "--lr", help="peak learning rate"),
                rank: int = typer.Option(16, "--rank", min=1, max=512, help="LoRA rank"),
                alpha: float = typer.Option(32.0, "--alpha", help="LoRA alpha"),
                seed: int = typer.Option(0, "--seed", help="the trainer's seed")):
    """Write a bundle for GRPO on a GPU machine: TRL samples groups of completions and rewards each
    with its example's Kiln scorer (Kiln's scoring module travels with it, byte for byte), so
    the reward there is the score `kiln eval run` gives here."""
    from kiln.protocol.store.hf_bundles import canonical_jsonl
    from kiln.native import scoring

    from .hf_script import GRPO_SCRIPT
    try:
        s = scoring.read_suite_file(suite)
    except scoring.SuiteError as e:
        fail(f"{e}; nothing was written")
    system = [{"role": "system", "content": s.system_prompt}] if s.system_prompt else []
    rows = [{"id": ex["id"], "prompt": system + [{"role": m["role"], "content": m["content"]} for m in ex["messages"]],
             "example": {"target": ex["target"], "aliases": ex["aliases"]}, "scorer": ex["scorer"]}
            for ex in s.examples]
    repo = _hf_model(model, hf_model)
    folder = _write(name, {"dataset.jsonl": canonical_jsonl(rows), "train_trl.py": GRPO_SCRIPT.encode(),
                           "kiln_scoring.py": Path(scoring.__file__).read_bytes()},
                    {"kind": "grpo", "hf_model": repo, "model": model, "rows": len(rows), "suite": s.name,
                     "options": {"epochs": epochs, "lr": lr, "rank": rank, "alpha": alpha, "seed": seed,
                                 "num_generations": num_generations, "max_new_tokens": max_new_tokens,
                                 "temperature": temperature, "beta": beta}})
    typer.echo(f"wrote {folder}: {len(rows)} prompts of suite {s.name} for {repo}; on the GPU machine: python "
               f"train_trl.py, then `kiln train hf import-peft --bundle {name} --name ADAPTER`")


@hf_app.command("verify")
def verify(bundle: str = typer.Argument(..., help="a bundle's name or folder")):
    """Check every file of a bundle (and of the adapter it came back with) against its manifest."""
    from kiln.protocol.store.hf_bundles import BundleError
    from kiln.protocol.store.hf_bundles import verify as check
    folder = _folder(bundle)
    try:
        m = check(folder)
        back = (folder / "adapter" / "manifest.json").is_file() and check(folder / "adapter")
    except BundleError as e:
        fail(str(e))
    typer.echo(f"{folder}: {len(m['files'])} files match the manifest" + (" (and its adapter's)" if back else ""))


@hf_app.command("list")
def list_bundles(as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """The bundles under KILN_HOME/hf: kind, model, rows, whether an adapter came back."""
    rows = _bundles().list()
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for b in rows:
        typer.echo(f"{b['name']:<24}" + (b["error"] if "error" in b else
                   f"{b['kind']:<6}{b['rows'] or '-':>6} rows  {b['hf_model']}  {'trained' if b['trained'] else ''}"))


@hf_app.command("delete")
def delete(name: str = typer.Argument(..., help="the bundle's name")):
    """Delete a bundle and what came back with it."""
    from kiln.protocol.store.hf_bundles import BundleError
    try:
        _bundles().delete(name)
    except BundleError as e:
        fail(str(e))
    typer.echo(f"deleted bundle {name}")


@hf_app.command("import-peft")
def import_peft(bundle: str = typer.Option(..., "--bundle", help="a bundle's name, folder, or a .tar/.tar.gz of it"),
                name: str = typer.Option(..., "--name", help="the adapter's name in Kiln"),
                model: str = typer.Option("default", "--model", "-m", help="the base model it was trained on"),
                force: bool = typer.Option(False, "--force", help="replace an adapter of that name")):
    """Import the adapter a bundle came back with, once every byte matches its manifest."""
    import tempfile

    from kiln.protocol.store.hf_bundles import BundleError, unpack
    from kiln.protocol.store.hf_bundles import verify as check

    from .adapters import adapters_import
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(bundle)
        try:
            folder = unpack(p, Path(tmp) / "bundle") if p.is_file() else _folder(bundle)
            check(folder / "adapter")
        except BundleError as e:
            fail(str(e))
        adapters_import(str(folder / "adapter"), name=name, model=model, force=force)
