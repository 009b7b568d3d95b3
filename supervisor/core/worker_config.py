"""The [workers.<name>] tables: the fields a worker has, the settings each built-in kind reads, and
how a table becomes one or more workers (copies with `replicas`, pipeline stages with `split`)."""

from __future__ import annotations

from typing import Any

from .config_fields import ConfigError, Field, coerce as _coerce

KV_TYPES = ("f16", "q8_0", "q4_0")  # a KV cache's types (kiln.native.kv_types.KV_TYPE_NAMES, kept equal too)

WORKER_FIELDS: dict[str, Field] = {
    "kind": Field(str, None, "worker kind"),
    "enabled": Field(bool, True, "start it with kiln up"),
    "model": Field(str, "default", "model path, name, or 'default' (inference kinds)"),
    "module": Field(str, "", "python module to run (custom kinds)"),
    "threads": Field(int, 0, "compute threads (0: all cores)", 0, 1024),
    "split": Field(int, 1, "run the model as this many pipeline stages, each its own process holding a share of "
                   "its layers (NAME, NAME.stage1, …; on a cluster each on another node when it can): a model "
                   "no machine holds alone", 1, 16),
    "replicas": Field(int, 1, "copies of this worker, named NAME, NAME.2, …: requests for it go to the copy "
                      "with the least outstanding work (on a cluster the copies spread over the nodes)", 1, 64),
    "settings": Field(dict, {}, "kind-specific settings, passed to the worker as they are"),
}
BUILTIN_KINDS = {"inference": "kiln.workers.inference", "moe-stream": "kiln.workers.moe_stream",
                 "trainer": "kiln.workers.trainer", "evaluator": "kiln.workers.evaluator",
                 "stage": "kiln.workers.stage"}
# the `settings` each built-in kind reads (a custom kind's are passed through unchecked): a
# misspelt key must fail at load, not be ignored
_INFERENCE_SETTINGS = {
    "ctx": "context length (default: the model's trained context)",
    "parallel": "sequences decoded together (default 4)",
    "prefill_ratio": "a decode step carrying a prompt's chunk takes this many plain steps' time (default 3)",
    "prefill_chunk": "a fixed prompt chunk instead (tokens)",
    "speculative": "check prompt-lookup or draft-model drafts (default true)",
    "draft_model": "a model with the same vocabulary that drafts tokens (path or library name)",
    "draft_min": "check at least this many draft tokens a step (default 0: as they pay)",
    "weights": "mapped (default: the file's page cache, shared between processes) or private (copied "
               "into huge pages: faster decode where the page cache holds 4 KiB pages; a moe-stream "
               "worker copies all but its experts)",
    "kv_type": "the KV cache's type: f16, q8_0 or q4_0 (default: [models] kv_type)",
    "kv_type_k": "the keys' type only (llama.cpp's -ctk)",
    "kv_type_v": "the values' type only (llama.cpp's -ctv)",
    "prefix_cache": "RAM for blocks of prompts any sequence computed, shared by all of them: auto (one "
                    "sequence's whole-context KV, at most 1 GiB), a size, or off",
    "prefix_cache_disk": "disk for those blocks under KILN_HOME/cache/prefix, read back after a restart "
                         "and by other workers of the model: auto (4 GiB), a size, or off",
    "slot_save_path": "a folder where llama-server's POST /slots/{id}?action=save|restore keeps a slot's "
                      "KV cache (its --slot-save-path; without it those actions are refused)",
    "mmproj": "the vision projector (an mmproj GGUF: path or library name) — default: the one beside the "
              "model that belongs to it; \"off\": none (llama-server's --mmproj)",
    "context_shift": "an answer reaching the context's end drops the older half after the first tokens and "
                     "goes on (llama-server's --context-shift; default false: it stops, \"length\")",
    "stage": "[0, N]: the first of N pipeline stages (written by `split = N`)",
    "stages": "the later stages' worker names, in order (written by `split = N`)",
    "pipeline_prefill": "a split model's prompt sent to the next stage in parts, both stages computing at "
                        "once: auto (default: when that stage is on another machine — on one, they would "
                        "share its cores), true or false",
}
_STAGE_SETTINGS = {"stage": "[index, N]: which of the N pipeline stages this worker runs",
                   "ctx": "the first stage's context", "parallel": "the first stage's slots (its caches are kept "
                   "for that many sequences and a few more)", "weights": "mapped or private",
                   "kv_type": "the KV cache's type", "kv_type_k": "the keys' type", "kv_type_v": "the values' type"}
KV_SETTINGS = ("kv_type", "kv_type_k", "kv_type_v")
KIND_SETTINGS: dict[str, dict[str, str]] = {
    "inference": _INFERENCE_SETTINGS,
    "moe-stream": {**_INFERENCE_SETTINGS,
                   "expert_cache": "expert cache size: 2GiB, 25% (of RAM) or auto",
                   "cache_policy": "lru, lfu or lrfu (default)",
                   "direct": "read experts with O_DIRECT (default true)",
                   "cache_memory": "auto (default), shared (warm restarts) or private (huge pages)"},
    "trainer": {},
    "evaluator": {},
    "stage": _STAGE_SETTINGS,
}
DEFAULT_WORKERS = {"default": {"kind": "inference", "model": "default"},
                   "trainer": {"kind": "trainer", "model": "default"},
                   "evaluator": {"kind": "evaluator"}}



def _worker(name: str, table: Any) -> dict:
    where = f"workers.{name}"
    if not isinstance(table, dict):
        raise ConfigError(f"[{where}] must be a table")
    unknown = set(table) - set(WORKER_FIELDS)
    if unknown:
        raise ConfigError(f"[{where}] unknown key(s) {sorted(unknown)}; allowed: {', '.join(WORKER_FIELDS)}")
    if "kind" not in table:
        raise ConfigError(f"[{where}] needs a kind (one of {', '.join(BUILTIN_KINDS)}, or any kind with a module)")
    out = {}
    for k, f in WORKER_FIELDS.items():
        out[k] = _coerce(f"{where}.{k}", f, table[k], False) if k in table else \
            (dict(f.default) if isinstance(f.default, dict) else f.default)
    if out["kind"] not in BUILTIN_KINDS and not out["module"]:
        raise ConfigError(f"[{where}] kind {out['kind']!r} is not built in "
                          f"(built in: {', '.join(BUILTIN_KINDS)}); give its module")
    known = KIND_SETTINGS.get(out["kind"]) if not out["module"] else None
    if known is not None:
        bad = sorted(set(out["settings"]) - set(known))
        if bad:
            allowed = "; ".join(f"{k}: {d}" for k, d in known.items()) or "none"
            raise ConfigError(f"[{where}] unknown setting(s) {bad} for kind {out['kind']!r}; allowed — {allowed}")
    for k in KV_SETTINGS:
        if k in out["settings"] and known is not None and k in known and out["settings"][k] not in KV_TYPES:
            raise ConfigError(f"[{where}] settings.{k} = {out['settings'][k]!r} is not valid: must be one of "
                              f"{', '.join(KV_TYPES)}")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"[{where}] worker names use letters, digits, '-' and '_'")
    return out


def _split(name: str, w: dict, count: int, replicas: int) -> dict:
    """A worker run as `count` pipeline stages: itself the first (embeddings, its share of the
    layers, the logits), NAME.stage1 … the later ones (workers/stage.py)."""
    if w["kind"] != "inference" or w["module"]:
        raise ConfigError(f"[workers.{name}] split = {count}: only an inference worker's model can be split")
    if replicas > 1:
        raise ConfigError(f"[workers.{name}] split and replicas together are not supported yet: choose one")
    st = w["settings"]
    for key in ("stage", "stages"):
        if key in st:
            raise ConfigError(f"[workers.{name}] settings.{key} is written by split; leave it out")
    names = [f"{name}.stage{i}" for i in range(1, count)]
    out = {name: {**w, "settings": {**st, "stage": [0, count], "stages": names}, "pipeline": name}}
    shared = {k: st[k] for k in ("ctx", "parallel", "weights", *KV_SETTINGS) if k in st}
    for i, n in enumerate(names, 1):
        out[n] = {"kind": "stage", "enabled": w["enabled"], "model": w["model"], "module": "", "threads": w["threads"],
                  "settings": {**shared, "stage": [i, count]}, "pipeline": name}
    return out
