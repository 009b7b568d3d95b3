"""Chat templates: the GGUF's `tokenizer.chat_template`, rendered as transformers renders it,
inside jinja2's immutable sandbox (a template is code from the model file: it must not reach
Python internals)."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
