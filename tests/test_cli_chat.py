"""`kiln chat`'s slash commands on their own (fast tier): /help, /reset, /model, /adapter,
/save, /exit, and an unknown command that is answered instead of sent to the model; and the
question `kiln run` asks when text is piped in, on real pipes and a pseudo-terminal."""

import json
import os
import pty

import pytest
import typer

from kiln.supervisor.cli.chat import CHAT_HELP, ChatState, piped_prompt


def _pipe(data: bytes | None):
    """The read end of a pipe as a text file: `data` written and the pipe closed, or (None) a
    pipe whose writer stays open and silent."""
    r, w = os.pipe()
    if data is not None:
        os.write(w, data)
        os.close(w)
    return os.fdopen(r, "r"), w


def test_piped_text_comes_before_the_argument_as_ollama_run_does():
    stdin, _ = _pipe(b"The sky is blue.\n")
    assert piped_prompt("Summarize.", stdin) == "The sky is blue. Summarize."
    stdin, _ = _pipe(b"What is 2+2?\n")
    assert piped_prompt(None, stdin) == "What is 2+2?"
    stdin, _ = _pipe(b"")                                   # /dev/null-like: ended, nothing in it
    assert piped_prompt("hi", stdin) == "hi"


def test_a_silent_open_pipe_or_a_terminal_is_not_read_when_there_is_an_argument():
    stdin, w = _pipe(None)
    try:
        assert piped_prompt("hi", stdin, grace=0.05) == "hi"
    finally:
        os.close(w)
    leader, follower = pty.openpty()
    tty = os.fdopen(follower, "r")
    try:
        os.write(leader, b"typed ahead\n")
        assert piped_prompt("hi", tty) == "hi"
    finally:
        tty.close()
        os.close(leader)


def test_nothing_to_ask_is_a_usage_error():
    stdin, _ = _pipe(b"  \n")
    with pytest.raises(typer.Exit) as e:
        piped_prompt(None, stdin)
    assert e.value.exit_code == 2


def test_help_reset_and_exit():
    st = ChatState("default", "be brief", None)
    assert st.slash("/help") == CHAT_HELP and "/save" in CHAT_HELP
    st.history += [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert st.slash("/reset") == "(history cleared)"
    assert st.history == [{"role": "system", "content": "be brief"}]
    assert not st.done and st.slash("/exit") == "" and st.done


def test_model_and_adapter_switch():
    st = ChatState("default", None, None)
    assert st.slash("/model") == "model: default"
    assert st.slash("/model smol", route=lambda m: f"worker-for-{m}") == "(now talking to worker-for-smol)"
    assert st.worker == "worker-for-smol"
    assert "active one" in st.slash("/adapter")
    st.slash("/adapter kind")
    assert st.adapter == "kind"
    st.slash("/adapter -")
    assert st.adapter == ""


def test_save_writes_the_conversation(tmp_path):
    st = ChatState("default", None, None)
    st.history.append({"role": "user", "content": "hi"})
    out = tmp_path / "chat.json"
    assert "saved 1" in st.slash(f"/save {out}")
    assert json.loads(out.read_text())["messages"] == [{"role": "user", "content": "hi"}]
    assert st.slash("/save").startswith("usage")
    assert "cannot save" in st.slash(f"/save {tmp_path}/no/such/dir/x.json")


def test_an_unknown_command_is_not_sent():
    st = ChatState("default", None, None)
    assert "unknown command /halp" in st.slash("/halp")
    assert st.history == []
