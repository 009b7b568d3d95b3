"""Evaluation suites and scorers: what an example is, and whether an answer passes.

A scorer turns (answer, example) into an `Outcome`: pass | fail | invalid (the answer has no
gradable content: no number where a number was asked for, no choice, no JSON) | error (the
scorer itself could not run, e.g. a bad regex). Suites are validated before any generation, and
every error names the path of the bad field (`examples[3].scorer.atol`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("pass", "fail", "invalid", "error")
SCORERS = ("exact_match", "contains", "regex", "numeric_tolerance", "multiple_choice", "json_validity",
           "all", "any")


class SuiteError(ValueError):
    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclass
class Outcome:
    outcome: str
    score: float
    detail: str = ""


SUITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _last_number(text: str) -> float | None:
    cleaned = text.replace("$", "").replace("%", "")
    found = [m.group().replace(",", "") for m in _NUMBER.finditer(cleaned)]
    for tok in reversed(found):
        try:
            return float(tok)
        except ValueError:
            continue
    return None


def _targets(example: dict) -> list[str]:
    t = example.get("target")
    return [str(t)] + [str(a) for a in example.get("aliases", [])]


def score(answer: str, example: dict, spec: dict) -> Outcome:
    """Score `answer` for `example` with scorer `spec` ({"type": name, ...options})."""
    kind = spec["type"]
    if kind in ("exact_match", "contains") and not answer.strip():
        return Outcome("invalid", 0.0, "the answer is empty")
    try:
        if kind == "exact_match":
            norm = lambda s: (s.strip() if spec.get("strip_whitespace", True) else s)  # noqa: E731
            fold = (lambda s: s) if spec.get("case_sensitive", False) else str.casefold
            ok = any(fold(norm(answer)) == fold(norm(t)) for t in _targets(example))
            return Outcome("pass" if ok else "fail", float(ok))
        if kind == "contains":
            phrases = spec.get("phrases") or _targets(example)
            hay = answer.casefold()
            hits = [p.casefold() in hay for p in phrases]
            ok = all(hits) if spec.get("mode", "any") == "all" else any(hits)
            return Outcome("pass" if ok else "fail", float(ok), f"{sum(hits)}/{len(hits)} phrases")
        if kind == "regex":
            m = re.search(spec["pattern"], answer)
            if m is None:
                return Outcome("invalid", 0.0, "pattern not found in the answer")
            group = spec.get("capture_group")
            if group is None:
                return Outcome("pass", 1.0)
            got = m.group(group)
            ok = got is not None and any(got.strip() == t.strip() for t in _targets(example))
            return Outcome("pass" if ok else "fail", float(ok), f"captured {got!r}")
        if kind == "numeric_tolerance":
            got = _last_number(answer)
            if got is None:
                return Outcome("invalid", 0.0, "no number in the answer")
            want = float(str(example["target"]).replace(",", ""))
            ok = math.isclose(got, want, rel_tol=spec.get("rtol", 0.0), abs_tol=spec.get("atol", 1e-9))
            return Outcome("pass" if ok else "fail", float(ok), f"got {got:g}, want {want:g}")
        if kind == "multiple_choice":
            choices = [str(c) for c in spec["choices"]]
            pat = r"(?<![A-Za-z0-9])(" + "|".join(re.escape(c) for c in sorted(choices, key=len, reverse=True)) + r")(?![A-Za-z0-9])"
            picks = re.findall(pat, answer)
            if not picks:
                return Outcome("invalid", 0.0, f"none of {choices} in the answer")
            ok = picks[0] == str(example["target"])
            return Outcome("pass" if ok else "fail", float(ok), f"chose {picks[0]}")
        if kind == "json_validity":
            text = answer.strip()
            if text.startswith("```"):
                text = text.strip("`").removeprefix("json").strip()
            try:
                obj = json.loads(text)
            except ValueError as e:
                return Outcome("invalid", 0.0, f"not JSON: {e}")
            for path in spec.get("required_paths", []):
                node = obj
                for part in path.split("."):
                    if isinstance(node, dict) and part in node:
                        node = node[part]
                    elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                        node = node[int(part)]
                    else:
                        return Outcome("fail", 0.0, f"missing {path}")
            return Outcome("pass", 1.0)
        if kind in ("all", "any"):
            parts = [score(answer, example, s) for s in spec["scorers"]]
            if any(p.outcome == "error" for p in parts):
                return next(p for p in parts if p.outcome == "error")
            passed = [p.outcome == "pass" for p in parts]
            ok = all(passed) if kind == "all" else any(passed)
            if not ok and all(p.outcome == "invalid" for p in parts):
                return Outcome("invalid", 0.0, "; ".join(p.detail for p in parts))
            return Outcome("pass" if ok else "fail", float(ok), "; ".join(p.outcome for p in parts))
    except re.error as e:
        return Outcome("error", 0.0, f"bad pattern: {e}")
    except (KeyError, TypeError, ValueError) as e:
        return Outcome("error", 0.0, f"{type(e).__name__}: {e}")
    return Outcome("error", 0.0, f"unknown scorer {kind!r}")


# -- suites ------------------------------------------------------------------------------------

@dataclass
class Suite:
    name: str
    description: str
    default_scorer: dict
    generation: dict
    system_prompt: str | None
    examples: list[dict] = field(default_factory=list)

    @property
    def hash(self) -> str:
        body = json.dumps({"default_scorer": self.default_scorer, "generation": self.generation,
                           "system_prompt": self.system_prompt, "examples": self.examples}, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()


_GEN = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 256, "stop": [], "seed": 0}


def _check_scorer(spec: Any, path: str) -> dict:
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict) or spec.get("type") not in SCORERS:
        raise SuiteError(path, f"a scorer is a name or {{type: …}} with type one of {', '.join(SCORERS)}")
    kind = spec["type"]
    if kind == "regex":
        if not isinstance(spec.get("pattern"), str):
            raise SuiteError(f"{path}.pattern", "regex needs a pattern string")
        try:
            re.compile(spec["pattern"])
        except re.error as e:
            raise SuiteError(f"{path}.pattern", f"not a valid regular expression: {e}") from None
    if kind == "numeric_tolerance":
        for k in ("atol", "rtol"):
            if k in spec and (not isinstance(spec[k], (int, float)) or spec[k] < 0):
                raise SuiteError(f"{path}.{k}", "must be a number ≥ 0")
    if kind == "multiple_choice" and not (isinstance(spec.get("choices"), list) and spec["choices"]):
        raise SuiteError(f"{path}.choices", "multiple_choice needs a non-empty list of choices")
    if kind == "contains" and spec.get("mode", "any") not in ("any", "all"):
        raise SuiteError(f"{path}.mode", "mode is 'any' or 'all'")
    if kind in ("all", "any"):
        subs = spec.get("scorers")
        if not isinstance(subs, list) or not subs:
            raise SuiteError(f"{path}.scorers", f"{kind} needs a non-empty list of scorers")
        spec = dict(spec, scorers=[_check_scorer(s, f"{path}.scorers[{i}]") for i, s in enumerate(subs)])
    return spec


def load_suite(data: Any) -> Suite:
    """Validate a suite (a parsed JSON object); raise SuiteError naming the bad field."""
    if not isinstance(data, dict):
        raise SuiteError("$", "a suite is a JSON object")
    if not isinstance(data.get("name"), str) or not SUITE_NAME.fullmatch(data["name"]):
        raise SuiteError("name", "required: letters, digits, '.', '_' or '-' (at most 64; it names the suite's file)")
    default = _check_scorer(data.get("default_scorer", "exact_match"), "default_scorer")
    gen = dict(_GEN)
    for k, v in (data.get("generation") or {}).items():
        if k not in _GEN:
            raise SuiteError(f"generation.{k}", f"unknown; known: {', '.join(_GEN)}")
        if k == "stop":
            if not (isinstance(v, list) and all(isinstance(x, str) and x for x in v)):
                raise SuiteError("generation.stop", "a list of non-empty strings")
        elif not isinstance(v, (int, float)) or isinstance(v, bool):
            raise SuiteError(f"generation.{k}", "must be a number")
        gen[k] = v
    examples = data.get("examples")
    if not isinstance(examples, list) or not examples:
        raise SuiteError("examples", "required, a non-empty list")
    out, ids = [], set()
    for i, ex in enumerate(examples):
        p = f"examples[{i}]"
        if not isinstance(ex, dict):
            raise SuiteError(p, "each example is an object")
        msgs = ex.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
                for m in msgs):
            raise SuiteError(f"{p}.messages", "a non-empty list of {role: system|user|assistant, content: str}")
        if "target" not in ex:
            raise SuiteError(f"{p}.target", "required")
        if "weight" in ex and (not isinstance(ex["weight"], (int, float)) or ex["weight"] <= 0):
            raise SuiteError(f"{p}.weight", "must be a number > 0")
        if "aliases" in ex and not isinstance(ex["aliases"], list):
            raise SuiteError(f"{p}.aliases", "must be a list")
        if "tags" in ex and not (isinstance(ex["tags"], list) and all(isinstance(t, str) for t in ex["tags"])):
            raise SuiteError(f"{p}.tags", "must be a list of strings")
        scorer = _check_scorer(ex["scorer"], f"{p}.scorer") if "scorer" in ex else default
        eid = ex.get("id") or hashlib.sha256(json.dumps([msgs, ex["target"]], sort_keys=True).encode()).hexdigest()[:12]
        if eid in ids:
            raise SuiteError(f"{p}.id", f"duplicate id {eid!r}")
        ids.add(eid)
        out.append({"id": eid, "messages": msgs, "target": ex["target"], "aliases": ex.get("aliases", []),
                    "tags": ex.get("tags", []), "scorer": scorer, "weight": ex.get("weight", 1)})
    return Suite(data["name"], data.get("description", ""), default, gen, data.get("system_prompt"), out)


def read_suite_file(path) -> Suite:
    """A suite from a JSON file, or a header JSON whose examples are in `examples.jsonl` beside
    it (one example per line). Errors name the file and the bad field or line."""
    from pathlib import Path
    from kiln.native.data_file import DataFileError, read_data_file
    path = Path(path)
    try:
        data = json.loads(read_data_file(path))
    except DataFileError as e:
        raise SuiteError(str(path), str(e).removeprefix(f"{path}: ")) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SuiteError(str(path), f"not valid JSON: {e}") from None
    if isinstance(data, dict) and "examples" not in data and (path.parent / "examples.jsonl").is_file():
        try:
            lines = read_data_file(path.parent / "examples.jsonl").decode("utf-8").splitlines()
        except (DataFileError, UnicodeDecodeError) as e:
            raise SuiteError(str(path.parent / "examples.jsonl"), str(e)) from None
        examples = []
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    examples.append(json.loads(line))
                except ValueError as e:
                    raise SuiteError(f"{path.parent / 'examples.jsonl'} line {n}", f"not valid JSON: {e}") from None
        data = dict(data, examples=examples)
    try:
        return load_suite(data)
    except SuiteError as e:
        raise SuiteError(f"{path}: {e.path}", str(e).split(": ", 1)[1]) from None
