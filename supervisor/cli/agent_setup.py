"""Pointing coding agents at Kiln: `kiln pi-setup` (the pi coding agent) and `kiln opencode-setup`.

Each merges a `kiln` provider into the agent's own JSON config, keeping every other key, after
copying the file to a timestamped `.bak-…` beside it. A file that is not valid JSON is left
untouched and reported: Kiln never rewrites a config it cannot read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path


class SetupError(Exception):
    """The agent's config cannot be updated; the message says why and nothing was written."""


def v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text() or "{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise SetupError(f"{path} is not valid JSON ({e}); fix or move it — nothing was changed") from None
    if not isinstance(doc, dict):
        raise SetupError(f"{path} does not hold a JSON object; nothing was changed")
    return doc


def write_json(path: Path, doc: dict, stamp: str) -> Path | None:
    """Back the file up (when it exists), then replace it atomically. Returns the backup."""
    path.parent.mkdir(parents=True, exist_ok=True)
    backup = None
    if path.exists():
        backup = path.with_name(f"{path.name}.bak-{stamp}")
        shutil.copy2(path, backup)
    tmp = path.with_name(f".{path.name}.kiln-tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return backup


def pi_docs(models_doc: dict, settings_doc: dict, url: str, models: list[dict], default_model: str,
            api_key: str = "") -> tuple[dict, dict]:
    """pi's models.json and settings.json with the kiln provider merged in."""
    models_doc = dict(models_doc)
    providers = dict(models_doc.get("providers") or {})
    providers["kiln"] = {
        "baseUrl": v1(url), "api": "openai-completions", "apiKey": api_key or "kiln",
        # Kiln takes system messages and chat_template_kwargs, not OpenAI's developer role or effort
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": m["id"], "name": f"{m['id']} (Kiln)",
                    **({"contextWindow": m["n_ctx"]} if m.get("n_ctx") else {})} for m in models],
    }
    models_doc["providers"] = providers
    settings_doc = dict(settings_doc, defaultProvider="kiln", defaultModel=default_model)
    return models_doc, settings_doc


def opencode_doc(doc: dict, url: str, models: list[dict], default_model: str, api_key: str = "") -> dict:
    """opencode.json with an @ai-sdk/openai-compatible `kiln` provider merged in."""
    doc = dict(doc)
    doc.setdefault("$schema", "https://opencode.ai/config.json")
    providers = dict(doc.get("provider") or {})
    options = {"baseURL": v1(url)}
    if api_key:
        options["apiKey"] = api_key
    providers["kiln"] = {"npm": "@ai-sdk/openai-compatible", "name": "Kiln", "options": options,
                         "models": {m["id"]: {"name": f"{m['id']} (Kiln)"} for m in models}}
    doc["provider"] = providers
    doc["model"] = f"kiln/{default_model}"
    return doc


def setup_pi(home: Path, url: str, models: list[dict], default_model: str, api_key: str = "") -> dict:
    agent = home / ".pi" / "agent"
    mpath, spath = agent / "models.json", agent / "settings.json"
    mdoc, sdoc = read_json(mpath), read_json(spath)           # both read before either is written
    mdoc, sdoc = pi_docs(mdoc, sdoc, url, models, default_model, api_key)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return {"models": str(mpath), "models_backup": _s(write_json(mpath, mdoc, stamp)),
            "settings": str(spath), "settings_backup": _s(write_json(spath, sdoc, stamp)),
            "base_url": v1(url), "default_model": default_model}


def setup_opencode(home: Path, url: str, models: list[dict], default_model: str, api_key: str = "") -> dict:
    path = home / ".config" / "opencode" / "opencode.json"
    doc = opencode_doc(read_json(path), url, models, default_model, api_key)
    backup = write_json(path, doc, time.strftime("%Y%m%d-%H%M%S"))
    return {"config": str(path), "backup": _s(backup), "base_url": v1(url), "default_model": default_model}


def _s(p: Path | None) -> str | None:
    return str(p) if p else None
