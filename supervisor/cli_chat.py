"""`kiln run` and `kiln chat`: talk to an inference worker through the daemon (starting one
if none runs), streaming the answer to the terminal."""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

import typer

from kiln.protocol import vocab

from .cli_engine import fail


def _ensure_daemon(model: Optional[str]):
    from .client import ControlClient, DaemonNotRunning
    from .paths import Paths
    try:
        return ControlClient(Paths.from_env())
    except DaemonNotRunning:
        pass
    typer.echo("kiln: no daemon running; starting `kiln up --detach`" + (f" --model {model}" if model else ""), err=True)
    args = [sys.executable, "-m", "kiln.supervisor.cli", "up", "--detach"] + (["--model", model] if model else [])
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        fail((r.stderr or r.stdout).strip().removeprefix("kiln: "))
    return ControlClient(Paths.from_env())


def _pick_worker(client, model: Optional[str]) -> str:
    """The worker that serves `model` (the router's answer, without waiting); says so when it is
    still loading — the router itself waits for it when the question is sent."""
    from .client import CommandFailed
    try:
        r = client.command("route", {"model": model} if model else {})
    except CommandFailed as e:
        hint = f"; `kiln down` then `kiln up --model {model}`" if e.code == "model_not_found" else ""
        fail(e.message + hint)
    if r["state"] == vocab.FATAL:
        fail(f"worker {r['worker']} is fatal: {r['reason']} (`kiln restart {r['worker']}` once fixed)")
    if not vocab.serving(r["state"], r["worker_state"]):
        typer.echo(f"kiln: worker {r['worker']} is {r['worker_state'] or r['state']}; the answer starts when it "
                   f"is ready", err=True)
    return r["worker"]


def _stream_answer(client, worker: str, messages: list[dict], params: dict, adapter: Optional[str] = None) -> str:
    """Print the answer as it arrives; Ctrl-C cancels it (KeyboardInterrupt propagates). The
    router waits for the worker while it loads or restarts, and retries a request a crash cut
    before its first token."""
    from .client import CommandFailed
    out = []
    body = {"messages": messages, "params": params, "worker": worker, "timeout": 3600}
    if adapter is not None:
        body["adapter"] = adapter
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
        raise
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


def run(prompt: str = typer.Argument(..., help="what to ask"),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="worker name or model to use"),
        temperature: Optional[float] = typer.Option(None, "--temperature", "-t"),
        max_tokens: int = typer.Option(512, "--max-tokens"),
        seed: Optional[int] = typer.Option(None, "--seed"),
        adapter: Optional[str] = typer.Option(None, "--adapter", help="LoRA adapter to apply (\"\" for none; "
                                                                       "default: the active one)")):
    """Ask one question and stream the answer (starts the daemon if needed)."""
    with _ensure_daemon(model) as client:
        worker = _pick_worker(client, model)
        try:
            _stream_answer(client, worker, [{"role": "user", "content": prompt}], _params(temperature, max_tokens, seed),
                           adapter)
        except KeyboardInterrupt:
            raise typer.Exit(130)


def chat(model: Optional[str] = typer.Option(None, "--model", "-m", help="worker name or model to use"),
         temperature: Optional[float] = typer.Option(None, "--temperature", "-t"),
         max_tokens: int = typer.Option(512, "--max-tokens"),
         system: Optional[str] = typer.Option(None, "--system", help="system prompt"),
         adapter: Optional[str] = typer.Option(None, "--adapter", help="LoRA adapter to apply (\"\" for none; "
                                                                        "default: the active one)")):
    """Interactive chat with history. /reset clears it, /exit (or Ctrl-D) leaves; Ctrl-C stops
    the current answer, not the session."""
    with _ensure_daemon(model) as client:
        worker = _pick_worker(client, model)
        history: list[dict] = [{"role": "system", "content": system}] if system else []
        typer.echo(f"chatting with {worker} — /reset clears the history, /exit leaves", err=True)
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                typer.echo("")
                return
            except KeyboardInterrupt:
                typer.echo("")
                continue
            cmd = line.strip()
            if cmd in ("/exit", "/quit", "/bye"):
                return
            if cmd == "/reset":
                history = history[:1] if system else []
                typer.echo("(history cleared)", err=True)
                continue
            if not cmd:
                continue
            history.append({"role": "user", "content": line})
            try:
                answer = _stream_answer(client, worker, history, _params(temperature, max_tokens, None), adapter)
                history.append({"role": "assistant", "content": answer})
            except KeyboardInterrupt:
                sys.stdout.write("\n(answer stopped)\n")
                history.pop()
