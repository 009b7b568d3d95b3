"""On-policy distillation in-process (fast tier): a two-layer student of SmolLM2's vocabulary
learns from the whole default model and its reverse KL to it falls on held-out prompts; a run
stopped midway resumes to a bit-identical adapter; a teacher of another vocabulary, a prompt
file with bad lines and a URL teacher that answers nonsense are refused with what failed."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from conftest import tiny_path
from kiln.native.chat_template import template_for
from kiln.native.model import load_model
from kiln.native.training.opd import LocalTeacher, TeacherError, URLTeacher, heldout_kl
from kiln.native.training.opd_run import OPDRun, OPDSpec
from kiln.native.training.sft_data import DataError, load_opd_file

TOPICS = ["the sea", "a cat", "bread", "rain", "music", "trees", "the moon", "coffee", "winter", "a river",
          "books", "stars"]


@pytest.fixture(scope="module")
def pair(student_path, default_model):
    student = load_model(student_path)
    return student, LocalTeacher(default_model, student), template_for(student)


def prompts(tmp_path, topics, name="prompts.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Write one sentence about {t}."}]})
                         + "\n" for t in topics))
    return p


def test_distillation_lowers_the_students_kl_to_the_teacher_on_held_out_prompts(pair, tmp_path):
    student, teacher, tpl = pair
    spec = OPDSpec(samples=2, max_new_tokens=12, lr=5e-3, rank=8, schedule="constant", checkpoint_interval=1000)
    train = load_opd_file(prompts(tmp_path, TOPICS[:6]), tpl, student.tokenizer, 512, max_new_tokens=12)
    held = load_opd_file(prompts(tmp_path, TOPICS[9:], "held.jsonl"), tpl, student.tokenizer, 512, max_new_tokens=12)
    before = heldout_kl(student, teacher, held, spec)
    (tmp_path / "job").mkdir()
    run = OPDRun(student, train, spec, tmp_path / "job", teacher=teacher)
    seen = []
    assert run.run(on_step=seen.append) == "completed"
    after = heldout_kl(student, teacher, held, spec, run._student())
    print(f"held-out reverse KL per token (exact): {before['kl']:.3f} -> {after['kl']:.3f}")
    assert before["measure"] == "exact" and before["tokens"] == after["tokens"] == 3 * 2 * 12
    assert after["kl"] < 0.8 * before["kl"], (before, after)
    assert all(p.extra["sampled_tokens"] > 0 and "kl" in p.extra for p in seen)
    history = [json.loads(ln) for ln in (tmp_path / "job" / "losses.jsonl").read_text().splitlines()]
    assert len(history) == run.total_steps == 6 and "teacher_logprob" in history[0]


def test_a_stopped_distillation_resumes_to_a_bit_identical_adapter(pair, tmp_path):
    """Samples are drawn from the adapter as it stands and with seeds of (seed, step, prompt,
    sample): a stop mid-step leaves nothing drawn behind, and the resumed run samples what the
    uninterrupted one sampled."""
    student, teacher, tpl = pair
    train = load_opd_file(prompts(tmp_path, TOPICS[:4]), tpl, student.tokenizer, 512, max_new_tokens=6)
    spec = OPDSpec(samples=2, max_new_tokens=6, lr=5e-3, rank=4, seed=5, checkpoint_interval=1)
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    whole = OPDRun(student, train, spec, tmp_path / "a", teacher=teacher)
    assert whole.run() == "completed"
    calls = {"n": 0}

    def stop_later():
        calls["n"] += 1
        return calls["n"] > 9                     # in the middle of step 3's sampling
    assert OPDRun(student, train, spec, tmp_path / "b", teacher=teacher).run(stop_later) == "stopped"
    resumed = OPDRun(student, train, spec, tmp_path / "b", teacher=teacher)
    assert 0 < resumed.step < resumed.total_steps
    assert resumed.run() == "completed"
    for n in whole.names:
        for x, y in zip(whole.adapter.tensors[n], resumed.adapter.tensors[n]):
            assert np.array_equal(x, y), n


def test_a_teacher_of_another_vocabulary_is_refused(pair):
    student, _, _ = pair
    with pytest.raises(TeacherError, match="vocabularies differ .*the same tokenizer"):
        LocalTeacher(load_model(tiny_path("llama")), student)


def test_bad_prompt_lines_are_reported_by_number(pair, tmp_path):
    student, _, tpl = pair
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([json.dumps({"prompt": [{"role": "user", "content": "hi"}]}),
                            json.dumps({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                                                      "content": "done"}]}),
                            json.dumps({"prompt": [{"role": "user", "content": "hi"}], "completions": []}),
                            json.dumps({"prompt": [{"role": "user", "content": "word " * 300}]})]) + "\n")
    with pytest.raises(DataError) as e:
        load_opd_file(p, tpl, student.tokenizer, 256, max_new_tokens=64)
    msg = str(e.value)
    assert "line 2: prompt: the last message is the assistant's" in msg
    assert "line 3: unknown field(s) ['completions']" in msg
    assert "line 4:" in msg and "exceed max_seq_len 256" in msg and "line 1" not in msg


class Hostile(BaseHTTPRequestHandler):
    """An OpenAI-compatible teacher gone wrong, one way per path."""
    def log_message(self, *a):
        pass

    def do_POST(self):
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"])
        replies = {
            "/short/v1/completions": {"choices": [{"logprobs": {"token_logprobs": [None], "tokens": ["a"]}}]},
            "/nolp/v1/completions": {"choices": [{"text": "hello"}]},
            "/nan/v1/completions": {"choices": [{"logprobs": {"token_logprobs": [None] + ["NaN"] * (n - 1),
                                                              "tokens": ["x"] * n}}]},
            "/other/v1/completions": {"choices": [{"logprobs": {"token_logprobs": [None] + [-1.0] * (n - 1),
                                                                "tokens": ["zz"] * n}}]}}
        if self.path == "/error/v1/completions":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": "no such model"}')
            return
        body = b"not json" if self.path == "/junk/v1/completions" else json.dumps(replies[self.path]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def hostile():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("path, message", [
    ("short", "scored 1 tokens of the 4 sent"), ("nolp", "did not echo the prompt's log-probabilities"),
    ("nan", "not a finite number"), ("error", "answered HTTP 404"), ("junk", "not JSON"),
    ("other", "reads the student's token ids as other text")])
def test_a_url_teacher_that_answers_nonsense_is_a_clear_error(pair, hostile, path, message):
    student = pair[0]
    t = URLTeacher(f"{hostile}/{path}/v1")
    tokens = student.tokenizer.encode("The sea is wide and blue")[:4]
    with pytest.raises(TeacherError, match=message):
        if path == "other":
            t.check_vocabulary(tokens, student.tokenizer)
        else:
            t.logprobs(tokens, 2)


def test_a_teacher_url_must_be_http():
    with pytest.raises(TeacherError, match="not an http"):
        URLTeacher("file:///etc/passwd")
    with pytest.raises(TeacherError, match="cannot be reached"):
        URLTeacher("http://127.0.0.1:1").logprobs([1, 2, 3], 1)
