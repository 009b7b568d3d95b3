"""Chat templates: the GGUF's `tokenizer.chat_template`, rendered as transformers renders it,
inside jinja2's immutable sandbox (a template is code from the model file: it must not reach
Python internals)."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .vision.layout import IMAGE


class TemplateError(ValueError):
    """The chat template is missing, invalid, or refused these messages."""


def _raise(message: str):
    raise TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "",
                 origin: str = "model"):
        if not source:
            raise TemplateError(f"the {origin} has no chat template (tokenizer.chat_template); "
                                f"give one explicitly, or use the completions API with a raw prompt")
        try:
            self._template = _env().from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the {origin}'s chat template does not compile: {e}") from e
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TemplateError(f"messages[{i}] must be an object with a string 'role'")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # noqa: BLE001 - a template is untrusted code: report, never crash
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def template_for(model) -> ChatTemplate:
    tok = model.tokenizer
    sp = tok.special
    return ChatTemplate(model.gguf.get("tokenizer.chat_template"),
                        bos_token=tok.tokens[sp.bos] if sp.bos is not None else "",
                        eos_token=tok.tokens[sp.eos] if sp.eos is not None else "",
                        origin=f"model {model.path.name}")


_SENTINEL = "\ue000{}\ue001"


def render_and_tokenize(template: ChatTemplate, tokenizer, messages: list[dict],
                        add_generation_prompt: bool = True, images: list[list[int]] | None = None,
                        **extra) -> tuple[str, list[int]]:
    """Render `messages` and tokenize the result so that only the template's own markup can
    become control tokens: a user who types `<|im_start|>system` gets those characters as text.

    The template is rendered once with each message content replaced by a sentinel; the control
    tokens found in the template's text are tokenized as specials, every other run (template
    text and contents together) as plain text — which, for a prompt with no fake markup, gives
    exactly llama.cpp's tokenization of the whole rendered string.

    `images`: each image's ids (native/vision/layout.py), in the order of the IMAGE marks in the
    contents; the text on either side of a mark is tokenized apart, as llama.cpp's mtmd does."""
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **extra)
    images = list(images or [])
    if text.count(IMAGE) != len(images):
        raise TemplateError(f"the messages hold {text.count(IMAGE)} image marks for {len(images)} images "
                            f"(the template dropped a message with an image, or a content holds U+E002)")
    queue = iter(images)

    def encode(run: str, special: bool) -> list[int]:
        pieces = run.split(IMAGE)
        out: list[int] = []
        for i, piece in enumerate(pieces):
            if piece:
                out += tokenizer.encode(piece, special=special, add_bos=False)
            if i < len(pieces) - 1:
                out += next(queue)
        return out

    contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
    masked = [dict(m, content=_SENTINEL.format(i)) if c is not None else m
              for i, (m, c) in enumerate(zip(messages, contents))]
    shape = template.render(masked, add_generation_prompt=add_generation_prompt, **extra)
    rebuilt = shape
    for i, c in enumerate(contents):
        if c is not None:
            rebuilt = rebuilt.replace(_SENTINEL.format(i), c)
    if rebuilt != text:
        # the template transforms contents (trim, upper…): fall back to plain-text tokenization of
        # the contents by position is not possible; refuse markup in contents instead
        specials = [t for i, t in enumerate(tokenizer.tokens) if tokenizer.is_control(i)]
        if any(s in c for c in contents if c for s in specials):
            raise TemplateError("a message contains control-token markup and this model's template "
                                "transforms message contents; remove the markup")
        return text, list(tokenizer.encode("", special=True)) + encode(text, True)
    # split the sentinel-shaped render into template text and content slots
    pieces: list[tuple[str, bool]] = []          # (text, is_template)
    rest = shape
    while True:
        idx = rest.find("\ue000")
        if idx < 0:
            pieces.append((rest, True))
            break
        end = rest.index("\ue001", idx)
        pieces.append((rest[:idx], True))
        pieces.append((contents[int(rest[idx + 1:end])], False))
        rest = rest[end + 1:]
    # tokenize: control tokens inside template text are specials; all other text is plain
    ids: list[int] = list(tokenizer.encode("", special=True))   # BOS if the model adds one
    run = ""
    strip = False          # the last control token swallows the whitespace after it (Phi-3)
    for piece, is_template in pieces:
        parts = tokenizer.split_specials(piece) if is_template else [(piece, None)]
        for part, special_id in parts:
            if special_id is None:
                if strip and not run:
                    part = part.lstrip()
                    strip = bool(not part)
                run += part
            else:
                if run:
                    ids += encode(run, False)
                    run = ""
                ids.append(special_id)
                strip = tokenizer.rstrips(special_id)
    if run:
        ids += encode(run, False)
    return text, ids
