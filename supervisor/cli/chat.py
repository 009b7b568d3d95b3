"""`kiln run` and `kiln chat`: talk to an inference worker through the daemon (starting one
if none runs), streaming the answer to the terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from kiln.protocol import vocab
from kiln.native.vision.layout import IMAGE
from kiln.protocol.sampling import DEFAULT_MAX_TOKENS

from .engine import fail, note


def _ensure_daemon(model: Optional[str]):
    from ..bus.client import ControlClient, DaemonNotRunning
    from ..core.paths import Paths
    try:
        return ControlClient(Paths.from_env())
    except DaemonNotRunning:
        pass
    note("kiln: no daemon running; starting `kiln up --detach`" + (f" --model {model}" if model else ""))
    args = [sys.executable, "-m", "kiln.supervisor.cli", "up", "--detach"] + (["--model", model] if model else [])
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        fail((r.stderr or r.stdout).strip().removeprefix("kiln: "))
    return ControlClient(Paths.from_env())


def _pick_worker(client, model: Optional[str]) -> str:
    """The worker that serves `model` (the router's answer, without waiting); says so when it is
    still loading — the router itself waits for it when the question is sent."""
    from ..bus.client import CommandFailed
    try:
        r = client.command("route", {"model": model} if model else {})
    except CommandFailed as e:
        fail(e.message)                           # a model not found already names `kiln models list`
    if r["state"] == vocab.FATAL:
        fail(f"worker {r['worker']} is fatal: {r['reason']} (`kiln restart {r['worker']}` once fixed)")
    if not vocab.serving(r["state"], r["worker_state"]):
        note(f"kiln: worker {r['worker']} is {r['worker_state'] or r['state']}; the answer starts when it "
             f"is ready")
    return r["worker"]


class AnswerStopped(KeyboardInterrupt):
    """Ctrl-C during an answer; `partial` is what was shown of it."""

    def __init__(self, partial: str):
        super().__init__(partial)
        self.partial = partial


def _stream_answer(client, worker: str, messages: list[dict], params: dict, adapter: Optional[str] = None,
                   images: Optional[list] = None) -> str:
    """Print the answer as it arrives; Ctrl-C cancels it (KeyboardInterrupt propagates). The
    router waits for the worker while it loads or restarts, and retries a request a crash cut
    before its first token."""
    from ..bus.client import CommandFailed
    out = []
    body = {"messages": messages, "params": params, "worker": worker, "timeout": 3600}
    if adapter is not None:
        body["adapter"] = adapter
    if images:
        body["images"] = images
    calls = client.stream("generate", body, timeout=3600)
    try:
        for msg in calls:
            piece = msg.body["text"] if msg.type == "chunk" else msg.body.get("text", "")
            if piece:
                out.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:
        client.cancel(client.last_call_id)
        raise AnswerStopped("".join(out)) from None
    except CommandFailed as e:
        sys.stdout.write("\n")
        fail(f"{e.code}: {e.message}")
    sys.stdout.write("\n")
    return "".join(out)


def _params(temperature, max_tokens, seed) -> dict:
    p = {"max_tokens": max_tokens}
    if temperature is not None:
        p["temperature"] = temperature
    if seed is not None:
        p["seed"] = seed
    return p


def piped_prompt(prompt: Optional[str], stdin=None, grace: float = 0.5) -> str:
    """The question `kiln run` asks: text piped in on stdin first, then the argument — as
    `cat notes.txt | ollama run M "Summarize"` does. With an argument, stdin is read only when
    something arrives (or it ends) within `grace` seconds, so a script whose stdin is a pipe
    nobody writes to does not hang; without one, stdin is the whole question."""
    import select
    stdin = sys.stdin if stdin is None else stdin
    piped = ""
    if stdin is not None and not stdin.closed and not stdin.isatty():
        if prompt is None or select.select([stdin], [], [], grace)[0]:
            piped = stdin.read().strip()
    text = " ".join(t for t in (piped, (prompt or "").strip()) if t)
    if not text:
        fail("nothing to ask: give the question as an argument or pipe it in (`echo QUESTION | kiln run`)", 2)
    return text


def run(prompt: Optional[str] = typer.Argument(None, help="what to ask (text piped in on stdin comes before it)"),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="worker name or model to use"),
        temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="sampling temperature (0: greedy; default: the server's)"),
        max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=-1,
                                        help="longest answer, in tokens (-1: until the model stops or the context ends)"),
        seed: Optional[int] = typer.Option(None, "--seed", help="makes sampling repeatable"),
        adapter: Optional[str] = typer.Option(None, "--adapter", help="LoRA adapter to apply (\"\" for none; "
                                                                       "default: the active one)"),
        image: Optional[list[Path]] = typer.Option(None, "--image", "-i", help="an image to ask about (PNG, JPEG, "
                                                   "WebP, GIF, BMP; repeat for several): a vision model reads it")):
    """Ask one question and stream the answer (starts the daemon if needed)."""
    prompt = piped_prompt(prompt)
    images = read_images(image or [])
    messages, params = [{"role": "user", "content": IMAGE * len(images) + prompt}], _params(temperature, max_tokens, seed)
    model, messages, params, adapter = with_created_defaults(model, messages, params, adapter, max_tokens)
    with _ensure_daemon(model) as client:
        worker = _pick_worker(client, model)
        try:
            _stream_answer(client, worker, messages, params, adapter, images)
        except KeyboardInterrupt:
            raise typer.Exit(130)


def read_images(paths: list[Path]) -> list[bytes]:
    """Each file's bytes, its header checked here (what it is, its size) before the daemon sees it."""
    from kiln.native.vision.images import ImageError, check_header
    out = []
    for p in paths:
        try:
            data = p.read_bytes()
            check_header(data, str(p))
        except OSError as e:
            fail(f"--image {p}: {e.strerror or e}", 2)
        except ImageError as e:
            fail(f"--image {e}", 2)
        out.append(data)
    return out


def with_created_defaults(model, messages, params: dict, adapter, max_tokens: int):
    """A model made with `kiln models create`: its base runs the question, with its system
    prompt, parameters and adapter under what was given here (an unset --max-tokens included)."""
    from kiln.native.models.created import applied, load
    record = load(model) if model else None
    if record is None:
        return model, messages, params, adapter
    if max_tokens == DEFAULT_MAX_TOKENS:
        params = {k: v for k, v in params.items() if k != "max_tokens"}
    messages, params, adapter = applied(record, messages, params, adapter)
    params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    return record["path"], messages, params, adapter


CHAT_HELP = """commands:
  /help            this list
  /reset           forget the conversation (the system prompt stays)
  /model [NAME]    show or switch the model (a library model loads on demand)
  /adapter [NAME]  show or switch the LoRA adapter ("-" for none)
  /save FILE       write the conversation to FILE as JSON (messages)
  /exit            leave (also /quit, /bye, Ctrl-D)
Ctrl-C stops the answer being written, not the session."""


class ChatState:
    """What a chat session holds between turns; `slash` runs one /command on it (no I/O but
    the reply it returns, so it is tested on its own)."""

    def __init__(self, worker: str, system: str | None, adapter: str | None, session=None, params=None):
        self.worker, self.system, self.adapter = worker, system, adapter
        self.history: list[dict] = [{"role": "system", "content": system}] if system else []
        self.done = False
        self.session = session            # (Sessions, name): saved after every turn
        self.params = params or {}

    def resume(self) -> int:
        """Take the saved session's conversation, model and adapter; how many messages."""
        if not self.session:
            return 0
        store, name = self.session
        doc = store.load(name)
        if doc is None:
            return 0
        self.history = doc["messages"]
        self.worker = doc.get("model") or self.worker
        self.adapter = doc.get("adapter", self.adapter)
        sys_msgs = [m for m in self.history if m.get("role") == "system"]
        self.system = sys_msgs[0]["content"] if sys_msgs else self.system
        return len(self.history)

    def save(self) -> None:
        if self.session:
            store, name = self.session
            old = store.load(name) or {}
            store.save(name, {**old, "model": self.worker, "adapter": self.adapter, "params": self.params,
                              "messages": self.history})

    def slash(self, line: str, route=None) -> str:
        import json
        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if cmd in ("/exit", "/quit", "/bye"):
            self.done = True
            return ""
        if cmd == "/help":
            return CHAT_HELP
        if cmd == "/reset":
            self.history = self.history[:1] if self.system else []
            self.save()
            return "(history cleared)"
        if cmd == "/model":
            if not arg:
                return f"model: {self.worker}"
            self.worker = route(arg) if route else arg
            return f"(now talking to {self.worker})"
        if cmd == "/adapter":
            if not arg:
                return f"adapter: {self.adapter if self.adapter is not None else 'the active one'}"
            self.adapter = "" if arg in ("-", "none") else arg
            return f"(adapter: {self.adapter or 'none'})"
        if cmd == "/save":
            if not arg:
                return "usage: /save FILE"
            try:
                with open(arg, "w") as f:
                    json.dump({"model": self.worker, "messages": self.history}, f, indent=2, ensure_ascii=False)
            except OSError as e:
                return f"cannot save: {e}"
            return f"(saved {len(self.history)} messages to {arg})"
        return f"unknown command {cmd} — /help lists them (to send a line that starts with /, start it with //)"


def _swallow_typeahead() -> None:
    """Keys typed while an answer was printed are dropped, not sent as the next question."""
    try:
        import termios
        if sys.stdin.isatty():
            termios.tcflush(sys.stdin, termios.TCIFLUSH)
    except (ImportError, OSError, ValueError):
        pass


def chat(model: Optional[str] = typer.Option(None, "--model", "-m", help="worker name or model to use"),
         temperature: Optional[float] = typer.Option(None, "--temperature", "-t", help="sampling temperature (0: greedy; default: the server's)"),
         max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=-1,
                                        help="longest answer, in tokens (-1: until the model stops or the context ends)"),
         system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
         adapter: Optional[str] = typer.Option(None, "--adapter", help="LoRA adapter to apply (\"\" for none; "
                                                                        "default: the active one)"),
         session: Optional[str] = typer.Option(None, "--session", help="save the conversation as NAME (and resume "
                                                                       "it if it exists): kiln sessions list")):
    """Interactive chat with history. /help lists the commands (/reset, /model, /adapter, /save,
    /exit); Ctrl-C stops the current answer, not the session."""
    store = None
    if session:
        from ..core.paths import Paths
        from ..core.sessions import SessionError, Sessions
        store = Sessions(Paths.from_env().home)
        try:
            store.path(session)
            store.load(session)
        except SessionError as e:
            fail(str(e))
    with _ensure_daemon(model) as client:
        st = ChatState(_pick_worker(client, model), system, adapter,
                       session=(store, session) if store else None,
                       params={"temperature": temperature, "max_tokens": max_tokens})
        resumed = st.resume()
        if resumed and st.worker != model:
            st.worker = _pick_worker(client, st.worker)
        typer.echo(f"chatting with {st.worker}" + (f" — session {session}" + (f" resumed ({resumed} messages)"
                   if resumed else " (new)") if session else "") + " — /help for commands, /exit leaves", err=True)
        while not st.done:
            try:
                line = input(">>> ")
            except EOFError:
                typer.echo("")
                return
            except KeyboardInterrupt:
                typer.echo("")
                continue
            if not line.strip():
                continue
            if line.startswith("/") and not line.startswith("//"):
                reply = st.slash(line, route=lambda m: _pick_worker(client, m))
                if reply:
                    typer.echo(reply, err=True)
                continue
            text = line[1:] if line.startswith("//") else line
            st.history.append({"role": "user", "content": text})
            try:
                answer = _stream_answer(client, st.worker, st.history, _params(temperature, max_tokens, None), st.adapter)
                st.history.append({"role": "assistant", "content": answer})
                st.save()
            except AnswerStopped as e:
                # the turn stays, with what was shown of the answer (as the transcript on screen)
                sys.stdout.write("\n(answer stopped)\n")
                if e.partial:
                    st.history.append({"role": "assistant", "content": e.partial})
                    st.save()
                else:
                    st.history.pop()
            _swallow_typeahead()
