"""`kiln debug …` and `kiln eval perplexity`: the engine run in the CLI process, no daemon.

The debug commands' JSON shapes are stable: our own checks and tests parse them.
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from kiln.protocol.sampling import DEFAULT_MAX_TOKENS

from .engine import emit, fail, load_or_exit, note

debug_app = typer.Typer(help="Run the engine directly (no daemon): tokenize, logits, generate.",
                        no_args_is_help=True)


# -- debug -------------------------------------------------------------------------------------

@debug_app.command("tokenize")
def debug_tokenize(model: str = typer.Argument(..., help="path, name in a model folder, or 'default'"),
                   text: str = typer.Argument(..., help="the text to tokenize"),
                   no_special: bool = typer.Option(False, "--no-special",
                                                   help="treat control-token markup as plain text"),
                   as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Token ids of TEXT (no BOS unless the model's metadata asks for one)."""
    m = load_or_exit(model)
    ids = m.tokenizer.encode(text, special=not no_special)
    emit({"ids": ids}, as_json, lambda o: typer.echo(
        " ".join(f"{i}:{m.tokenizer.tokens[i]!r}" for i in o["ids"])))


@debug_app.command("logits")
def debug_logits(model: str = typer.Argument(..., help="path, name in a model folder, or 'default'"),
                 text: str = typer.Argument(..., help="the prompt, parsed with special tokens"),
                 top: int = typer.Option(20, "--top", help="alternatives per position"),
                 full_last: bool = typer.Option(False, "--full-last", help="add the whole last logit vector"),
                 as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Top-K logits at every prompt position (TEXT parsed with special tokens)."""
    import numpy as np
    m = load_or_exit(model)
    ids = m.tokenizer.encode(text, special=True)
    if not ids:
        fail("TEXT tokenizes to nothing")
    logits = m.forward(ids, m.new_cache(len(ids)), all_logits=True)
    positions = []
    for row in logits:
        best = np.argsort(-row, kind="stable")[:top]
        positions.append({"top_ids": [int(i) for i in best], "top_logits": [float(row[i]) for i in best]})
    out = {"ids": ids, "positions": positions}
    if full_last:
        out["last_logits"] = [float(x) for x in logits[-1]]

    def human(o):
        for i, (tid, pos) in enumerate(zip(o["ids"], o["positions"])):
            alts = ", ".join(f"{m.tokenizer.tokens[t]!r} {lg:.2f}" for t, lg in
                             zip(pos["top_ids"][:5], pos["top_logits"][:5]))
            typer.echo(f"{i:4d} {m.tokenizer.tokens[tid]!r:>16} → {alts}")
    emit(out, as_json, human)


@debug_app.command("generate")
def debug_generate(model: str = typer.Argument(..., help="path, name in a model folder, or 'default'"),
                   text: str = typer.Argument(..., help="the prompt, parsed with special tokens"),
                   max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=-1,
                                                  help="tokens to generate (-1: until the model stops or the context ends)"),
                   temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
                   top_k: int = typer.Option(40, "--top-k", help="keep the k most likely tokens (0: off)"),
                   top_p: float = typer.Option(0.95, "--top-p", help="nucleus sampling mass (1: off)"),
                   min_p: float = typer.Option(0.05, "--min-p", help="drop tokens below this share of the best (0: off)"),
                   repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="penalty for recent tokens (1: off)"),
                   seed: Optional[int] = typer.Option(None, "--seed", help="makes sampling repeatable"),
                   stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
                   ignore_eos: bool = typer.Option(False, "--ignore-eos", help="go on past the end-of-text token"),
                   as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Generate from TEXT (parsed with special tokens) and print ids and text."""
    from kiln.native.generate import ContextLengthError, generate_text
    from kiln.native.sampling import SamplingError, SamplingParams
    m = load_or_exit(model)
    try:
        prompt = m.tokenizer.encode(text, special=True)
        if max_tokens == DEFAULT_MAX_TOKENS:                # to the end of the model's context
            max_tokens = max(1, m.config.n_ctx_train - len(prompt))
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, seed=seed, max_tokens=max_tokens,
                                stop=stop, ignore_eos=ignore_eos).validate()
        ids, out, fin = generate_text(m, prompt, params)
    except (SamplingError, ContextLengthError) as e:
        fail(str(e))
    emit({"ids": ids, "text": out, "finish_reason": fin.reason}, as_json,
          lambda o: (sys.stdout.write(o["text"] + "\n"), sys.stdout.flush()))


eval_app = typer.Typer(help="Evaluate: suites (run, compare, replay) in the evaluator worker; perplexity.",
                        no_args_is_help=True)


@eval_app.command("perplexity")
def eval_perplexity(model: str = typer.Argument(..., help="path, name in a model folder, or 'default'"),
                    file: str = typer.Option(..., "--file", "-f", help="text file to score"),
                    ctx: int = typer.Option(512, "--ctx", help="chunk size in tokens"),
                    chunks: int = typer.Option(0, "--chunks", min=0,
                                               help="score only the first N chunks (0: all), as llama-perplexity's --chunks"),
                    as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Perplexity as llama-perplexity computes it: chunks of CTX tokens, second half scored."""
    from pathlib import Path

    from kiln.native.perplexity import perplexity
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read {file}: {e}")
    m = load_or_exit(model)

    def show(i, n, running):
        if not as_json:
            note(f"[{i}/{n}] {running:.4f}")
    try:
        r = perplexity(m, text, ctx, show, max_chunks=chunks or None)
    except ValueError as e:
        fail(str(e))
    out = {"model": m.path.name, "file": file, "ctx": ctx, "chunks": r.n_chunks, "scored_tokens": r.n_scored,
           "ppl": r.ppl, "ppl_err": r.ppl_err, "chunk_ppl": r.chunk_ppl}
    emit(out, as_json, lambda o: typer.echo(f"PPL = {o['ppl']:.4f} +/- {o['ppl_err']:.4f}"))
