"""SentencePiece vocabularies (Gemma, Llama 2, Phi-3) tokenize as llama.cpp's `llm_tokenizer_spm`.

The vocabularies in tests/data/spm were trained with the sentencepiece library with the options
of Gemma's tokenizer.model (no dummy prefix, byte fallback, split digits, user-defined whitespace
runs and turn markers) or Llama 2's (dummy prefix), and the expected ids were made by llama.cpp
from the same GGUF (tests/tools/make_spm_vocab.py says how). Each case pins one of llama.cpp's
rules: user-defined pieces merge first (score 0), the space prefix after every control token,
end-of-turn tokens forced to control type, the Phi-3 rule that control tokens swallow the
whitespace after them, byte fallback for unseen characters.
"""

import json
from pathlib import Path

import pytest

from kiln.native.chat_template import ChatTemplate, render_and_tokenize
from kiln.native.gguf_file import read_gguf
from kiln.native.tokenizer import GGUFTokenizer

DATA = Path(__file__).parent / "data" / "spm"
VARIANTS = ["gemma-like", "llama-like", "phi3-like"]


def _load(name):
    return GGUFTokenizer(read_gguf(DATA / f"spm-{name}.gguf")), json.loads((DATA / f"spm-{name}.json").read_text())


@pytest.mark.parametrize("name", VARIANTS)
def test_spm_vocabulary_tokenizes_like_llama_cpp(name):
    tok, ref = _load(name)
    assert tok.model_type == "llama"
    wrong = [(c["text"], c["special"]) for c in ref["cases"]
             if tok.encode(c["text"], special=c["special"]) != c["ids"]]
    assert not wrong, f"{len(wrong)} of {len(ref['cases'])} differ from llama.cpp: {wrong[:5]}"


def test_gemma_vocabulary_decodes_losslessly():
    tok, ref = _load("gemma-like")
    for case in ref["cases"]:
        if not case["special"]:
            assert tok.decode(case["ids"][1:]) == case["text"]       # after BOS


def test_end_of_turn_is_a_stop_and_a_control_token_even_when_the_file_says_user_defined():
    tok, _ = _load("gemma-like")
    eot = tok.id_of("<end_of_turn>")
    assert tok.is_control(eot) and eot in tok.special.stop_ids
    # and so user text cannot produce it
    assert eot not in tok.encode("hi<end_of_turn>", special=False)


def test_phi3_template_prompt_tokenizes_as_the_whole_rendered_string():
    """render_and_tokenize keeps user text out of control tokens; for a prompt without fake
    markup it must still give llama.cpp's ids for the whole string — with Phi-3's rstrip."""
    tok, _ = _load("phi3-like")
    template = ChatTemplate("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n"
                            "{% endfor %}<|assistant|>\n", bos_token="<s>", eos_token="</s>")
    text, ids = render_and_tokenize(template, tok, [{"role": "user", "content": "Hello there"}])
    assert ids == tok.encode(text, special=True)
    # the newlines went with rstrip; the space is the SPM prefix llama.cpp puts after a control token
    assert tok.decode(ids, skip_control=True) == " Hello there"
