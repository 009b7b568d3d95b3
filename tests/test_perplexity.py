"""Perplexity of the default model on GPL-3, computed as llama-perplexity does, against
llama.cpp's own figure (tests/data/perplexity/)."""

import json
import subprocess
import sys

import pytest

from conftest import DATA

pytestmark = pytest.mark.slow


CHUNKS = 3      # of llama.cpp's 14: its running figure after each is in the reference (the whole
                # text takes 40 s here; every chunk runs the same code)


def test_default_model_perplexity_is_within_half_a_percent_of_llama_cpp(default_model_path):
    ref = json.loads((DATA / "perplexity" / "smollm2-gpl3.json").read_text())["SmolLM2-135M-Instruct.Q4_1.gguf"]
    r = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "eval", "perplexity", str(default_model_path),
                        "--file", str(DATA / "perplexity" / "GPL-3.txt"), "--ctx", "512", "--chunks", str(CHUNKS),
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    per_chunk = ref["scored_tokens"] // ref["chunks"]
    assert (out["chunks"], out["scored_tokens"]) == (CHUNKS, CHUNKS * per_chunk)
    for ours, theirs in zip(out["chunk_ppl"], ref["running_ppl_per_chunk"][:CHUNKS], strict=True):
        assert abs(ours - theirs) / theirs <= 0.005, (out["chunk_ppl"], ref["running_ppl_per_chunk"][:CHUNKS])
    # the error estimate is llama-perplexity's: ppl * std(nll) / sqrt(n), the same size as its
    # figure over 14 chunks scaled by sqrt(14 / CHUNKS)
    expect_err = ref["ppl_err"] * (ref["chunks"] / CHUNKS) ** 0.5
    assert 0.6 * expect_err <= out["ppl_err"] <= 1.6 * expect_err, (out["ppl_err"], expect_err)
