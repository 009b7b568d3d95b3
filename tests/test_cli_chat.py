"""`kiln chat`'s slash commands on their own (fast tier): /help, /reset, /model, /adapter,
/save, /exit, and an unknown command that is answered instead of sent to the model."""

import json

from kiln.supervisor.cli_chat import CHAT_HELP, ChatState


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
