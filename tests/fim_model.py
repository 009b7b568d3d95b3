"""A code model for the fill-in-the-middle tests: tiny-qwen2 (random weights, llama.cpp's
reference) with six of its unused tokens renamed to Qwen2.5-Coder's FIM markers, control type,
found by their text as llama.cpp finds them. The weights are the reference's, so the answers
are deterministic, if meaningless."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

MARKERS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
FIRST = 269                                  # <|unused269|> … in tiny-qwen2's vocabulary


def build_fim_model(src: Path, out: Path, markers: list[str] = MARKERS) -> Path:
    return rename_tokens(src, out, {FIRST + i: name for i, name in enumerate(markers)}, "tiny qwen2 coder (FIM markers)")


def rename_tokens(src: Path, out: Path, names: dict[int, str], model_name: str | None = None) -> Path:
    """A copy of `src` whose tokens `names` maps (id -> new text) are renamed, as control tokens;
    the weights and every other key unchanged. Only unused or special tokens are renamed."""
    logging.getLogger("gguf-new-metadata").setLevel(logging.WARNING)
    reader = gguf.GGUFReader(src)
    tokens = list(reader.get_field("tokenizer.ggml.tokens").contents())
    types = list(reader.get_field("tokenizer.ggml.token_type").contents())
    for tid, name in names.items():
        assert types[tid] in (int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNUSED)), (tid, tokens[tid])
        tokens[tid], types[tid] = name, int(gguf.TokenType.CONTROL)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(out), arch=arch, endianess=reader.endianess)
    A, S, I = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32
    new = {"tokenizer.ggml.tokens": MetadataDetails(A, tokens, sub_type=S),
           "tokenizer.ggml.token_type": MetadataDetails(A, types, sub_type=I)}
    if model_name:
        new["general.name"] = MetadataDetails(S, model_name)
    copy_with_new_metadata(reader, writer, new, [])
    return out
