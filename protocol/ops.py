"""Request bodies of each op, declared in one place and validated at the boundary.

A schema maps field -> (type or tuple of types, required). Bodies are msgpack maps; a worker's
runtime validates an incoming request against its op's schema before the handler sees it.
"""

from __future__ import annotations

from typing import Any

from .sampling import out_of_bounds

Schema = dict[str, tuple[Any, bool]]
NUM = (int, float)

SCHEMAS: dict[str, Schema] = {
    # every worker
    "ping": {},
    "stats": {},
    # the test worker kind (tests/)
    "echo": {"value": (object, False)},
    "stream": {"n": (int, True), "size": (int, False), "delay": (NUM, False)},
    "crash": {"code": (int, False), "after": (NUM, False)},
    "hang": {"seconds": (NUM, False)},
    "sleep": {"seconds": (NUM, True)},
    "block": {"started": (str, True), "release": (str, True)},
    "ask_up": {"op": (str, True), "body": (dict, False)},
    "environ": {},
    # inference
    "generate": {"prompt": (list, False), "text": (str, False), "special": (bool, False), "messages": (list, False),
                 # fill-in-the-middle: prefix, suffix, middle, extra [[name, text]], repo_level
                 "infill": (dict, False),
                 # a grammar named outright (llama-server's grammar / json_schema): {"gbnf": text}
                 # or {"json_schema": schema}
                 "grammar": (dict, False),
                 "params": (dict, False), "session": (str, False), "adapter": (str, False),
                 "adapter_scale": ((int, float), False),
                 # chat: tools and constraints (checked for shape by the HTTP layer, against the
                 # model's template by the worker)
                 "tools": (list, False), "tool_choice": ((str, dict), False), "parallel_tool_calls": (bool, False),
                 "response_format": (dict, False), "chat_template_kwargs": (dict, False),
                 "reasoning_effort": (str, False),
                 # max_tokens as an upper bound: past the context's end the answer stops (length)
                 "clip_max_tokens": (bool, False),
                 # "auto": drop the oldest turns to fit the context (workers/context_fit.py)
                 "truncation": (str, False),
                 # template variables applied only where the template uses them (enable_thinking, …)
                 "template_hints": (dict, False),
                 # images (their bytes), each where an image mark is in messages (or the text's
                 # media marker): the model's vision projector reads them (workers/vision_ops.py)
                 "images": (list, False)},
    "embed": {"inputs": (list, True), "dimensions": (int, False), "adapter": (str, False), "normalize": (bool, False),
              "truncate": (bool, False),
              # llama-server's /embedding: its embd_normalize (-1 none, 0 max-abs, 2 euclidean, p>2 p-norm)
              # and, for a model that pools nothing, every token's vector
              "embd_normalize": (int, False), "per_token": (bool, False)},
    "rerank": {"query": (str, True), "documents": (list, True)},
    "tokenize": {"text": (str, True), "special": (bool, False), "add_bos": (bool, False), "pieces": (bool, False)},
    # llama-server's slots: list, or save / restore / erase slot `id` (a file of slot_save_path)
    "slots": {"action": (str, True), "id": (int, False), "filename": (str, False)},
    "score": {"prompt": (list, False), "text": (str, False), "special": (bool, False), "top": (int, False),
              "adapter": (str, False), "adapter_scale": ((int, float), False)},
    # evaluator
    "eval_register": {"file": (str, True)},
    "eval_submit": {"suite": (str, False), "file": (str, False), "inline": (dict, False), "adapter": (str, False),
                    "adapters": (list, False), "seed": (int, False), "worker": (str, False),
                    "replay_of": (str, False)},
    "openenv_submit": {"env": (str, True), "groups": (int, False), "group_size": (int, False), "seed": (int, False),
                       "max_steps": (int, False), "temperature": (NUM, False), "max_tokens": (int, False),
                       "model": (str, False), "adapter": (str, False), "train": (dict, False),
                       "eval_seeds": (int, False)},
    "openenv_resume": {"id": (str, True)},
    # trainer
    "train_submit": {"file": (str, True), "adapter": (str, True), "options": (dict, False), "method": (str, False),
                     "model": (str, False), "teacher": (str, False), "teacher_model": (str, False),
                     "eval_file": (str, False)},
    "job_cancel": {"id": (str, True)},
    # a pipeline stage (workers/stage.py): rows of hidden states (one float32 buffer) of the
    # sequences [[uid, start, rows], …] through its layers; `keep`: the row indices to send back
    "stage_forward": {"seqs": (list, True), "keep": (list, False)},
    "detokenize": {"tokens": (list, True)},
    # with tools (or template kwargs) the prompt is the one generate would run: chat_plan's
    "apply_template": {"messages": (list, True), "add_generation_prompt": (bool, False), "tools": (list, False),
                       "tool_choice": ((str, dict), False), "parallel_tool_calls": (bool, False),
                       "chat_template_kwargs": (dict, False), "reasoning_effort": (str, False),
                       "template_hints": (dict, False),
                 # images (their bytes), each where an image mark is in messages (or the text's
                 # media marker): the model's vision projector reads them (workers/vision_ops.py)
                 "images": (list, False)},
    "info": {},
}


class SchemaError(ValueError):
    pass


def validate_body(op: str, body: Any) -> dict:
    """Check `body` against `op`'s schema; unknown ops pass (the worker answers unknown_op)."""
    schema = SCHEMAS.get(op)
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise SchemaError(f"op {op!r}: body must be a map, got {type(body).__name__}")
    if schema is None:
        return body
    for name, (kind, required) in schema.items():
        if name not in body:
            if required:
                raise SchemaError(f"op {op!r}: field {name!r} is required")
            continue
        if kind is not object and (not isinstance(body[name], kind)
                                   or isinstance(body[name], bool) and kind in (int, NUM)):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise SchemaError(f"op {op!r}: field {name!r} must be {want}, got {type(body[name]).__name__}")
    unknown = set(body) - set(schema)
    if unknown:
        raise SchemaError(f"op {op!r}: unknown field(s) {sorted(unknown)}; known: {sorted(schema)}")
    why = out_of_bounds(body["params"]) if isinstance(body.get("params"), dict) else None
    if why:
        raise SchemaError(f"op {op!r}: params.{why}")
    return body
