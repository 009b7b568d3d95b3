"""Perplexity of the default model on GPL-3, computed as llama-perplexity does, against
llama.cpp's own figure (tests/data/perplexity/)."""

import json
import subprocess
import sys

import pytest

from conftest import DATA

pytestmark = pytest.mark.slow


def test_default_model_perplexity_is_within_half_a_percent_of_llama_cpp(default_model_path):
    ref = json.loads((DATA / "perplexity" / "smollm2-gpl3.json").read_text())["SmolLM2-135M-Instruct.Q4_1.gguf"]
    r = subprocess.run([sys.executable, "-m", "kiln.supervisor.cli", "eval", "perplexity", str(default_model_path),
                        "--file", str(DATA / "perplexity" / "GPL-3.txt"), "--ctx", "512", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["chunks"], out["scored_tokens"]) == (ref["chunks"], ref["scored_tokens"])
    assert abs(out["ppl"] - ref["ppl"]) / ref["ppl"] <= 0.005, (out["ppl"], ref["ppl"])
    assert abs(out["ppl_err"] - ref["ppl_err"]) / ref["ppl_err"] <= 0.05
