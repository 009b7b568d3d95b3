"""Fill-in-the-middle (code infilling): which tokens a model marks the gap with, and the prompt.

Code models (Qwen2.5-Coder, Qwen3-Coder, StarCoder2, Granite, DeepSeek-Coder, CodeLlama, GLM-4.5,
…) were trained on text cut in three: given the code before the cursor and the code after it,
they write what goes between. llama.cpp finds the marker tokens by the metadata
(`tokenizer.ggml.fim_*_token_id`) or, where the converter did not write it, by their text
(llama-vocab.cpp); so does Kiln, with the same lists. A model without the three markers cannot
infill: a request for it is refused, not answered as a plain completion.

Two layouts:
- plain (Ollama's `suffix`, OpenAI's `suffix`): `[BOS]<PRE>prefix<SUF>suffix<MID>`;
- repo-level (llama-server's `/infill`, https://arxiv.org/pdf/2409.12186): other files first,
  `<REPO>myproject\\n<SEP>name\\ntext…<SEP>filename\\n<PRE>prefix<SUF>suffix<MID>middle`, the prefix
  cut to its last 3/4 of a 2048-token window and the suffix to its first 1/4, the other files
  filling what the context has left — llama-server's format_prompt_infill, so a request sent
  there or here runs the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

# by the text, when the metadata does not say (llama-vocab.cpp's lists)
_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
WINDOW = 2048               # llama-server's default batch, which its prefix/suffix cut is made for
# the chunk separator llama-server puts between other files when the model has no file separator
_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def can_infill(self) -> bool:
        return None not in (self.pre, self.suf, self.mid)

    @property
    def ends(self) -> set[int]:
        """Tokens that end generation (llama.cpp makes the pad, repo and file separators EOG:
        a code model writes them when it would go on to another file)."""
        return {t for t in (self.pad, self.rep, self.sep) if t is not None}


def find_fim_tokens(meta: dict, vocab: dict[str, int]) -> tuple[FimTokens, set[int]]:
    """The markers, and those found by their text (llama.cpp makes these control tokens,
    whatever type the file gives them)."""
    found, by_text = {}, set()
    for role, texts in _TEXTS.items():
        tid = meta.get(f"tokenizer.ggml.fim_{role}_token_id")
        if tid is None:
            tid = next((vocab[t] for t in texts if t in vocab), None)
            if tid is not None:
                by_text.add(tid)
        # A hostile file may give any type here: only an id inside the vocabulary is a marker.
        ok = isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid < len(vocab)
        found[role] = int(tid) if ok else None
    return FimTokens(**found), by_text


class InfillError(ValueError):
    pass


def infill_prompt(tok, prefix: str, suffix: str, *, middle: str = "", extra: list[tuple[str, str]] = (),
                  repo_level: bool = False, n_ctx: int, n_predict: int = 0) -> list[int]:
    """The prompt tokens of an infill request (see the module's docstring). The texts are
    tokenized as plain text: a `<|fim_prefix|>` typed in the code stays text."""
    fim: FimTokens = tok.fim
    if not fim.can_infill:
        raise InfillError("this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                          "<|fim_middle|> or their kin); use a code model trained for infilling "
                          "(Qwen2.5-Coder, StarCoder2, Granite Code, CodeLlama, …)")
    enc = lambda s: tok.encode(s, special=False, add_bos=False) if s else []  # noqa: E731
    pre, suf, mid = enc(prefix), enc(suffix), enc(middle)
    bos = [tok.special.bos] if tok.special.add_bos and tok.special.bos is not None else []
    if not repo_level:
        return bos + [fim.pre] + pre + [fim.suf] + suf + [fim.mid] + mid
    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep] + enc("myproject\n")
    for name, text in extra:
        extra_ids += [fim.sep] + enc(name + "\n") if fim.sep is not None else enc(_CHUNK_SEPARATOR)
        extra_ids += enc(text)
    if fim.sep is not None:
        extra_ids += [fim.sep] + enc("filename\n")
    # Kiln's window is llama-server's batch, shrunk where the context is smaller, so that what it
    # keeps always fits with the answer
    window = max(8, min(WINDOW, n_ctx - max(n_predict, 0) - len(bos) - 3))
    n_pre = min(len(pre), 3 * (window // 4))
    n_suf = min(len(suf), max(0, window // 4 - (2 + len(mid))))
    n_extra = min(max(0, n_ctx - window - 2 * max(n_predict, 0)), len(extra_ids))
    kept_extra = extra_ids[len(extra_ids) - n_extra:] if n_extra else []
    return (kept_extra + bos + [fim.pre] + pre[len(pre) - n_pre:] + mid
            + [fim.suf] + suf[:n_suf] + [fim.mid])
