"""Supervised fine-tuning data: a JSONL file of conversations, validated and tokenized.

One conversation per line: {"messages": [{"role": ..., "content": ...}, ...]}. The whole file
is checked before anything trains, and every problem is reported with its line number.

Each conversation is rendered with the model's chat template. The loss covers the assistant
tokens only: for the i-th message, if it is the assistant's, its tokens are those that
render(messages[:i+1]) adds after render(messages[:i], add_generation_prompt=True) — the
reply and its end-of-turn token, not the generation prompt, nor whatever the template puts
after the end-of-turn token (a newline).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..chat_template import ChatTemplate, TemplateError, render_and_tokenize
from ..data_file import DataFileError, read_data_file

ROLES = ("system", "user", "assistant", "tool")
MAX_ERRORS = 20


@dataclass
class Example:
    line: int
    tokens: list[int]
    targets: list[int]            # positions j whose token is learned (predicted at j - 1)


class DataError(ValueError):
    def __init__(self, path, problems: list[str], total: int):
        more = f"\n  … and {total - len(problems)} more" if total > len(problems) else ""
        super().__init__(f"{path}: {total} problem{'s' if total != 1 else ''} in the training data; "
                         f"nothing was queued:\n  " + "\n  ".join(problems) + more)
        self.problems, self.total = problems, total


def _check_messages(obj) -> str | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list):
        return 'expected an object {"messages": [...]}'
    msgs = obj["messages"]
    if not msgs:
        return "messages is empty"
    for k, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"messages[{k}] is not an object"
        if m.get("role") not in ROLES:
            return f"messages[{k}].role {m.get('role')!r} is not one of {', '.join(ROLES)}"
        c = m.get("content")
        if not isinstance(c, str) or not c.strip():
            return f"messages[{k}].content is empty" if isinstance(c, str) or c is None \
                else f"messages[{k}].content must be a string"
    if not any(m["role"] == "assistant" for m in msgs):
        return "no assistant turn: there is nothing to learn"
    return None


def encode_conversation(template: ChatTemplate, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(tokens, target positions) of one conversation."""
    full = render_and_tokenize(template, tokenizer, messages, add_generation_prompt=False)[1]
    stops = tokenizer.special.stop_ids
    targets: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_and_tokenize(template, tokenizer, messages[:i], add_generation_prompt=True)[1] if i else \
            render_and_tokenize(template, tokenizer, [], add_generation_prompt=True)[1]
        after = render_and_tokenize(template, tokenizer, messages[:i + 1], add_generation_prompt=False)[1]
        if after[:len(before)] != before or full[:len(after)] != after:
            raise TemplateError("the chat template does not render this conversation as a growing prefix, "
                                "so the assistant tokens cannot be told apart")
        span = list(range(len(before), len(after)))
        for k, pos in enumerate(span):
            if after[pos] in stops:              # keep the end-of-turn token, drop what follows it
                span = span[:k + 1]
                break
        targets += [p for p in span if p > 0]
    return full, targets


class _Bad(ValueError):
    """One line's problem (reported with its line number)."""


def _load_jsonl(path: str | Path, template: ChatTemplate | None, parse, what: str, raw: bytes | None = None) -> list:
    """Validate and parse the whole file with `parse(obj, line)`; raise DataError listing every
    bad line (a line's problem is a _Bad)."""
    path = Path(path)
    if template is None:
        raise DataError(path, ["the model has no chat template, so conversations cannot be rendered"], 1)
    try:
        raw = read_data_file(path) if raw is None else raw
    except DataFileError as e:
        raise DataError(path, [str(e)], 1) from None
    problems, total, items = [], 0, []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _Bad(f"not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
            items.append(parse(obj, n))
        except _Bad as e:
            total += 1
            if len(problems) < MAX_ERRORS:
                problems.append(f"line {n}: {e}")
    if total:
        raise DataError(path, problems, total)
    if not items:
        raise DataError(path, [f"the file holds no {what}"], 1)
    return items


def _example(template, tokenizer, messages: list[dict], max_seq_len: int, line: int) -> Example:
    try:
        tokens, targets = encode_conversation(template, tokenizer, messages)
    except TemplateError as e:
        raise _Bad(f"cannot render with the chat template: {e}") from None
    if len(tokens) > max_seq_len:
        raise _Bad(f"{len(tokens)} tokens after templating, longer than max_seq_len {max_seq_len}")
    if not targets:
        raise _Bad("no assistant token survives templating")
    return Example(line, tokens, targets)


def load_sft_file(path: str | Path, template: ChatTemplate | None, tokenizer, max_seq_len: int,
                  raw: bytes | None = None) -> list[Example]:
    """Validate and tokenize the whole file; raise DataError listing every bad line."""
    def parse(obj, n):
        why = _check_messages(obj)
        if why:
            raise _Bad(why)
        return _example(template, tokenizer, obj["messages"], max_seq_len, n)
    return _load_jsonl(path, template, parse, "conversations", raw)


def _check_prompt(obj, shape: str, answer: str) -> None:
    """A line's {"prompt": [messages]}: messages that end before the assistant's turn."""
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), list) or not obj["prompt"]:
        raise _Bad(f"expected {shape}")
    why = _check_messages({"messages": obj["prompt"] + [{"role": "assistant", "content": "x"}]})
    if why:
        raise _Bad("prompt: " + why)
    if obj["prompt"][-1].get("role") == "assistant":
        raise _Bad(f"prompt: the last message is the assistant's; {answer} are the answer")


@dataclass
class Group:
    """GRPO: completions of one prompt (each an Example whose targets are its tokens) and rewards."""
    line: int
    completions: list[Example]
    rewards: list[float]


def load_grpo_file(path: str | Path, template: ChatTemplate | None, tokenizer, max_seq_len: int,
                   raw: bytes | None = None) -> list[Group]:
    """One group per line: {"prompt": [messages], "completions": [{"text" | "messages", "reward"}, …]}
    with at least two completions; validated whole, bad lines reported by number. A completion's
    `messages` are the turns after the prompt — an agent's actions and what it saw between them,
    assistant first and last — and every assistant turn of them is learned with the completion's
    advantage (an OpenEnv episode of several steps); the prompt's own turns never are."""
    import math

    def parse(obj, n):
        _check_prompt(obj, '{"prompt": [messages], "completions": [{"text", "reward"}, …]}', "the completions")
        comps = obj.get("completions")
        if not isinstance(comps, list) or len(comps) < 2:
            raise _Bad("completions: at least two completions per group (advantages compare them)")
        try:
            start = len(render_and_tokenize(template, tokenizer, obj["prompt"], add_generation_prompt=True)[1])
        except TemplateError as e:
            raise _Bad(f"cannot render with the chat template: {e}") from None
        examples, rewards = [], []
        for k, c in enumerate(comps):
            turns = _completion_turns(c, k)
            r = c.get("reward")
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise _Bad(f"completions[{k}]: reward must be a finite number, got {json.dumps(r)[:20]}")
            ex = _example(template, tokenizer, obj["prompt"] + turns, max_seq_len, n)
            learned = [j for j in ex.targets if j >= start]
            if not learned:
                raise _Bad(f"completions[{k}]: no token of it survives templating")
            examples.append(Example(n, ex.tokens, learned))
            rewards.append(float(r))
        return Group(n, examples, rewards)
    return _load_jsonl(path, template, parse, "groups", raw)


def _completion_turns(c, k: int) -> list[dict]:
    """A completion's turns: its text as the one assistant turn, or its messages checked."""
    if not isinstance(c, dict) or ("text" in c) == ("messages" in c):
        raise _Bad(f"completions[{k}]: give text (the answer) or messages (the turns after the prompt)")
    if "text" in c:
        if not isinstance(c["text"], str) or not c["text"].strip():
            raise _Bad(f"completions[{k}]: needs a non-empty text")
        return [{"role": "assistant", "content": c["text"]}]
    turns = c["messages"]
    why = _check_messages({"messages": turns}) if isinstance(turns, list) and turns else "messages is empty"
    if why:
        raise _Bad(f"completions[{k}].{why}")
    for i, m in enumerate(turns):
        if m["role"] != ("assistant" if i % 2 == 0 else "user") or set(m) - {"role", "content"}:
            raise _Bad(f"completions[{k}].messages[{i}]: the turns alternate assistant, user, … (role and "
                       f"content only)")
    if turns[-1]["role"] != "assistant":
        raise _Bad(f"completions[{k}].messages: the last turn is the assistant's (what follows is not learned)")
    return turns


@dataclass
class Prompt:
    """OPD: a prompt the student answers itself (its tokens end with the generation prompt)."""
    line: int
    tokens: list[int]


def load_opd_file(path: str | Path, template: ChatTemplate | None, tokenizer, max_seq_len: int,
                  raw: bytes | None = None, max_new_tokens: int = 0) -> list[Prompt]:
    """One prompt per line: {"prompt": [messages]}; a prompt plus `max_new_tokens` sampled
    tokens must fit in max_seq_len. Validated whole, bad lines reported by number."""
    def parse(obj, n):
        _check_prompt(obj, '{"prompt": [messages]}', "the student's samples")
        extra = set(obj) - {"prompt"}
        if extra:
            raise _Bad(f"unknown field(s) {sorted(extra)}: a line is {{\"prompt\": [messages]}}")
        try:
            tokens = render_and_tokenize(template, tokenizer, obj["prompt"], add_generation_prompt=True)[1]
        except TemplateError as e:
            raise _Bad(f"cannot render with the chat template: {e}") from None
        if len(tokens) + max_new_tokens > max_seq_len:
            raise _Bad(f"{len(tokens)} prompt tokens + max_new_tokens {max_new_tokens} exceed max_seq_len "
                       f"{max_seq_len}")
        return Prompt(n, tokens)
    return _load_jsonl(path, template, parse, "prompts", raw)
