"""Models made from a Modelfile (`kiln models create NAME -f Modelfile`, Ollama's `/api/create`):
a small manifest over a base model — no copy of its weights — with its own system prompt,
sampling defaults, adapter and opening messages, applied under a request's own fields.

A manifest is `$KILN_HOME/created/NAME.json`: {name, from (as written), path (the base file it
resolved to), system, parameters (Kiln's names), adapter, messages, license, modelfile}.

Modelfile instructions (Ollama's): FROM, PARAMETER, SYSTEM, ADAPTER, MESSAGE, LICENSE, with
`\"\"\"…\"\"\"` for multi-line values and `#` comments. TEMPLATE is refused: Kiln renders the model's
own Jinja chat template and cannot run Ollama's Go templates. A PARAMETER Kiln does not have is
an error naming its line, never dropped.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Callable

from .folders import kiln_home

NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,63}$")
MAX_MODELFILE = 1 << 20
# Ollama's PARAMETER name -> Kiln's sampling field ("stop" repeats: a list)
PARAMETERS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
              "typical_p": "typical_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repeat_penalty",
              "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty", "num_predict": "max_tokens", "num_ctx": "min_ctx"}
ROLES = ("system", "user", "assistant")


class ModelfileError(ValueError):
    pass


def created_dir() -> Path:
    return kiln_home() / "created"


def plain_name(name: str) -> str:
    """`name` without Ollama's `:latest`; ModelfileError unless it is a plain model name."""
    base = name[:-len(":latest")] if name.endswith(":latest") else name
    if not NAME.match(base):
        raise ModelfileError(f"{name!r} is not a model name (letters, digits, '_', '.', '-'; at most 64)")
    return base


def parse_modelfile(text: str, bounds: Callable[[dict], str | None] = lambda p: None) -> dict:
    """The instructions of a Modelfile as a spec: {from, system, parameters, adapter, messages,
    license}. ModelfileError naming the line for anything Kiln cannot do as written; `bounds`:
    why sampling values are out of range, or None (protocol/sampling.py's, passed in by callers)."""
    if len(text) > MAX_MODELFILE:
        raise ModelfileError(f"the Modelfile is {len(text):,} characters; at most {MAX_MODELFILE:,}")
    spec: dict = {"parameters": {}, "messages": []}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        no, line = i + 1, lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if rest.startswith('"""'):                        # a value over several lines
            body = rest[3:]
            while '"""' not in body and i < len(lines):
                body += "\n" + lines[i]
                i += 1
            if '"""' not in body:
                raise ModelfileError(f"line {no}: the \"\"\" opened here is never closed")
            rest = body[:body.index('"""')]
        where = f"line {no}: {word}"
        if word == "FROM":
            if not rest:
                raise ModelfileError(f"{where} needs a model (a library name, a path, hf.co/ORG/REPO:QUANT)")
            spec["from"] = rest
        elif word == "SYSTEM":
            spec["system"] = rest
        elif word == "LICENSE":
            spec["license"] = rest
        elif word == "ADAPTER":
            if not rest:
                raise ModelfileError(f"{where} needs an adapter name (`kiln adapters list`)")
            spec["adapter"] = rest
        elif word == "MESSAGE":
            role, _, content = rest.partition(" ")
            if role not in ROLES:
                raise ModelfileError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
            spec["messages"].append({"role": role, "content": content.strip()})
        elif word == "PARAMETER":
            name, _, value = rest.partition(" ")
            _parameter(spec["parameters"], name, value.strip(), where, bounds)
        elif word == "TEMPLATE":
            raise ModelfileError(f"{where}: Kiln renders the model's own chat template (Jinja, from the GGUF) "
                                 f"and cannot run Ollama's Go templates; leave TEMPLATE out")
        else:
            raise ModelfileError(f"{where}: unknown instruction (FROM, PARAMETER, SYSTEM, ADAPTER, MESSAGE, LICENSE)")
    if "from" not in spec:
        raise ModelfileError("the Modelfile has no FROM line: name the model it builds on")
    return spec


def _parameter(out: dict, name: str, value: str, where: str, bounds) -> None:
    if name not in PARAMETERS:
        raise ModelfileError(f"{where} {name!r} is not supported (supported: {', '.join(PARAMETERS)})")
    field = PARAMETERS[name]
    if field == "stop":
        out.setdefault("stop", []).append(value.strip('"'))
        return
    try:
        number = json.loads(value)
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ModelfileError(f"{where} {name} needs a number, got {value!r}")
    if field == "min_ctx":
        if not isinstance(number, int) or number <= 0:
            raise ModelfileError(f"{where} num_ctx must be a positive integer")
    else:
        why = bounds({field: number})
        if why:
            raise ModelfileError(f"{where}: {why.replace(field, name, 1)}")
    out[field] = number


def to_modelfile(spec: dict) -> str:
    """The spec as a Modelfile (`kiln models show NAME --modelfile`, /api/show)."""
    out = [f"FROM {spec['from']}"]
    names = {v: k for k, v in PARAMETERS.items()}
    for field, value in spec.get("parameters", {}).items():
        for v in (value if isinstance(value, list) else [value]):
            out.append(f"PARAMETER {names[field]} {json.dumps(v)}")
    if spec.get("adapter"):
        out.append(f"ADAPTER {spec['adapter']}")
    if spec.get("system") is not None:
        out.append(f'SYSTEM """{spec["system"]}"""')
    for m in spec.get("messages", []):
        out.append(f"MESSAGE {m['role']} {m['content']}")
    if spec.get("license"):
        out.append(f'LICENSE """{spec["license"]}"""')
    return "\n".join(out) + "\n"


def save(name: str, spec: dict, path: Path) -> dict:
    """Write the manifest of `name` over the base file `path` (atomically)."""
    record = {**spec, "name": plain_name(name), "path": str(path), "created_at": time.time()}
    d = created_dir()
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{record['name']}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, d / f"{record['name']}.json")
    return record


def load(name: str) -> dict | None:
    """The manifest a model name (`NAME`, `NAME:latest`) stands for, or None."""
    try:
        base = plain_name(name)
    except ModelfileError:
        return None
    p = created_dir() / f"{base}.json"
    try:
        record = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("name") == base else None


def listed() -> list[dict]:
    d = created_dir()
    out = []
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        record = load(p.stem)
        if record is not None:
            out.append(record)
    return out


def delete(name: str) -> bool:
    try:
        (created_dir() / f"{plain_name(name)}.json").unlink()
        return True
    except (FileNotFoundError, ModelfileError):
        return False


def applied(record: dict, messages: list | None, params: dict, adapter: str | None) -> tuple[list | None, dict, str | None]:
    """A request's messages, params and adapter with the created model's defaults under them:
    its SYSTEM unless the request has a system message, its MESSAGEs before the request's (after
    the system message), its PARAMETERs where the request says nothing, its ADAPTER unless the
    request names one."""
    if messages is not None:
        head = [m for m in messages[:1] if isinstance(m, dict) and m.get("role") in ("system", "developer")]
        system = head or ([{"role": "system", "content": record["system"]}] if record.get("system") else [])
        messages = system + list(record.get("messages") or []) + messages[len(head):]
    params = {**{k: v for k, v in (record.get("parameters") or {}).items() if k != "min_ctx"}, **params}
    return messages, params, adapter if adapter is not None else record.get("adapter")
