"""What the completions and embeddings routes take as input — a prompt, token ids, or a batch of
either; an embedding's inputs — as work items, or a 400 naming the field."""

from __future__ import annotations

from .openai_validate import bad, number


def _is_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def prompts(body: dict) -> list[dict]:
    """A completions prompt — a string, token ids, or a batch of either — as work items; with a
    `suffix`, one fill-in-the-middle item (the prompt is the code before the gap)."""
    prompt, suffix = body.get("prompt"), body.get("suffix")
    if suffix not in (None, ""):
        if not isinstance(suffix, str):
            raise bad("suffix", "suffix must be a string (the text after the gap to fill)", "invalid_type")
        if not isinstance(prompt, str):
            raise bad("prompt", "with a suffix, prompt must be one string: the text before the gap", "invalid_type")
        if body.get("echo"):
            raise bad("echo", "echo cannot be combined with suffix")
        return [{"infill": {"prefix": prompt, "suffix": suffix}}]
    batch = prompt if isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or _is_ids(p) for p in prompt) and not _is_ids(prompt) else [prompt]
    works = []
    for i, p in enumerate(batch):
        where = "prompt" if len(batch) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            if not p:
                raise bad(where, "prompt is empty")
            works.append({"text": p, "special": True})
        elif _is_ids(p):
            works.append({"prompt": p})
        else:
            raise bad(where, "prompt must be a non-empty string, a list of token ids, or a list of those",
                      "invalid_type")
    if len(works) > 64:
        raise bad("prompt", f"at most 64 prompts per request, got {len(works)}")
    return works


def embedding_inputs(body: dict) -> list:
    """input: a string, a list of strings, a list of token ids, or a list of those."""
    x = body.get("input")
    items = [x] if isinstance(x, str) or _is_ids(x) else x
    if not isinstance(items, list) or not items:
        raise bad("input", "input must be a non-empty string, a list of strings, token ids, or lists of token ids",
                  "invalid_type")
    for i, it in enumerate(items):
        if not ((isinstance(it, str) and it) or _is_ids(it)):
            raise bad(f"input[{i}]", "each input must be a non-empty string or a non-empty list of token ids")
    if len(items) > 256:
        raise bad("input", f"at most 256 inputs per request, got {len(items)}")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad("encoding_format", 'encoding_format must be "float" or "base64"')
    number(body, "dimensions", 1, 1 << 16, int)     # its type here; the worker refuses any but the model's own
    return items
