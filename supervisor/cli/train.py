"""`kiln train …`: LoRA fine-tuning jobs (SFT, GRPO, on-policy distillation) through the running
daemon."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kiln.protocol import vocab

from .engine import fail, verbosity

train_app = typer.Typer(help="Fine-tune the model with LoRA (jobs run in the trainer worker).", no_args_is_help=True)


def _client():
    from ..bus.client import ControlClient, DaemonNotRunning
    from ..core.paths import Paths
    try:
        return ControlClient(Paths.from_env())
    except DaemonNotRunning as e:
        fail(str(e))


def _cmd(client, name: str, args: dict | None = None):
    from ..bus.client import CommandFailed
    try:
        return client.command(name, args or {}, 30)
    except CommandFailed as e:
        fail(e.message)
    except TimeoutError as e:
        fail(str(e))


def _routed(client, op: str, args: dict):
    """A routed op (train.cancel, eval.cancel): the router takes it to the job's worker."""
    from ..bus.client import CommandFailed
    try:
        return [m for m in client.stream(op, args, timeout=60)][-1].body
    except CommandFailed as e:
        fail(e.message)
    except TimeoutError as e:
        fail(str(e))


# -- train ---------------------------------------------------------------------------------------

@train_app.command("sft")
def sft(file: Path = typer.Option(..., "--file", "-f", help="JSONL: one {\"messages\": [...]} conversation per line"),
        adapter: str = typer.Option(..., "--adapter", "-a", help="name of the adapter to make"),
        epochs: Optional[int] = typer.Option(None, "--epochs", help="passes over the data (default 1)"),
        lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate (default 2e-4)"),
        rank: Optional[int] = typer.Option(None, "--rank", help="LoRA rank (default 16)"),
        alpha: Optional[float] = typer.Option(None, "--alpha", help="LoRA alpha (default 32)"),
        targets: Optional[str] = typer.Option(None, "--targets", help="comma list among attn_q,attn_k,attn_v,"
                                                                      "attn_output,ffn_gate,ffn_up,ffn_down (default: all)"),
        max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="longest conversation, tokens (default 512)"),
        checkpoint_interval: Optional[int] = typer.Option(None, "--checkpoint-interval", help="steps between checkpoints (default 50)"),
        seed: Optional[int] = typer.Option(None, "--seed", help="shuffling and initialisation seed"),
        grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="conversations per optimizer step (default 1)"),
        warmup: Optional[int] = typer.Option(None, "--warmup", help="warmup steps (default 0)"),
        schedule: Optional[str] = typer.Option(None, "--schedule", help="cosine (default) or constant"),
        weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help="AdamW weight decay"),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="base model (default: the trainer's)"),
        follow: bool = typer.Option(False, "--follow", help="then follow the job until it ends"),
        smoke: list[str] = typer.Option([], "--adapter-smoke-test", help="after the job: answer this prompt with "
                                        "the base model and with the new adapter, side by side (repeatable; "
                                        "follows the job)"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Queue a LoRA fine-tuning job. The whole file is checked first; problems are listed with
    their line numbers and nothing is queued."""
    if not file.is_file():
        fail(f"{file}: no such file")
    options = {"epochs": epochs, "lr": lr, "rank": rank, "alpha": alpha, "max_seq_len": max_seq_len,
               "checkpoint_interval": checkpoint_interval, "seed": seed, "grad_accum": grad_accum,
               "warmup": warmup, "schedule": schedule, "weight_decay": weight_decay,
               "targets": [t.strip() for t in targets.split(",") if t.strip()] if targets else None}
    _queue("sft", file, adapter, options, model, follow, as_json, "conversations", "target tokens", smoke)


def _queue(method: str, file: Path, adapter: str, options: dict, model: Optional[str], follow: bool,
           as_json: bool, items: str, tokens: str, smoke: list[str] = (), extra: dict | None = None) -> None:
    """Submit a training job (the trainer checks the whole file first) and report or follow it;
    with smoke prompts, follow it and then answer them with and without the adapter."""
    follow = follow or bool(smoke)
    from ..bus.client import CommandFailed
    body = {"file": str(file.resolve()), "adapter": adapter, "method": method,
            "options": {k: v for k, v in options.items() if v is not None},
            **{k: v for k, v in (extra or {}).items() if v is not None}}
    if model:
        body["model"] = model
    with _client() as c:
        try:
            job = [m for m in c.stream("train.submit", body, timeout=600)][-1].body
        except CommandFailed as e:
            fail(e.message)
        if as_json and not follow:
            typer.echo(json.dumps(job))
            return
        typer.echo(f"queued {job['id']}: adapter {adapter}, {job['spec']['examples']} {items}, "
                   f"{job['spec']['target_tokens']} {tokens}")
        if follow:
            _follow(c, job["id"], as_json)
        if smoke:
            _smoke(c, adapter, model, list(smoke), as_json)


SMOKE_TOKENS = 64


def _smoke(c, adapter: str, model: Optional[str], prompts: list[str], as_json: bool) -> None:
    """--adapter-smoke-test: each prompt answered greedily by the base model and with the adapter."""
    from ..bus.client import CommandFailed
    rows = []
    for prompt in prompts:
        row = {"prompt": prompt}
        for label, name in (("base", ""), ("adapter", adapter)):
            body = {"messages": [{"role": "user", "content": prompt}], "adapter": name,
                    "params": {"max_tokens": SMOKE_TOKENS, "temperature": 0}, **({"model": model} if model else {})}
            try:
                msgs = list(c.stream("generate", body, timeout=300))
            except (CommandFailed, TimeoutError) as e:
                fail(f"smoke test {prompt!r} ({label}): {getattr(e, 'message', e)}")
            row[label] = "".join(m.body.get("text", "") for m in msgs if isinstance(m.body, dict)).strip()
        rows.append(row)
    if as_json:
        typer.echo(json.dumps({"smoke_test": rows}))
        return
    typer.echo(f"smoke test (greedy, up to {SMOKE_TOKENS} tokens):")
    for row in rows:
        typer.echo(f"  {row['prompt']}\n    base:    {row['base']}\n    {adapter}: {row['adapter']}")


@train_app.command("grpo")
def grpo(file: Path = typer.Option(..., "--file", "-f", help='JSONL: one {"prompt": [messages], "completions": '
                                   '[{"text", "reward"}, …]} group per line (two or more completions; a completion '
                                   'of several turns gives "messages" instead of "text")'),
         adapter: str = typer.Option(..., "--adapter", "-a", help="name of the adapter to make"),
         epochs: Optional[int] = typer.Option(None, "--epochs", help="passes over the groups (default 1)"),
         lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate (default 2e-4)"),
         rank: Optional[int] = typer.Option(None, "--rank", help="LoRA rank (default 16)"),
         alpha: Optional[float] = typer.Option(None, "--alpha", help="LoRA alpha (default 32)"),
         beta: Optional[float] = typer.Option(None, "--beta", help="weight of the KL penalty to the base model "
                                              "(default 0.04)"),
         clip: Optional[float] = typer.Option(None, "--clip", help="policy-ratio clip range (default 0.2)"),
         grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="groups per optimizer step (default 1)"),
         seed: Optional[int] = typer.Option(None, "--seed", help="shuffling and initialisation seed"),
         max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="longest prompt + completion, tokens "
                                                   "(default 512)"),
         model: Optional[str] = typer.Option(None, "--model", "-m", help="base model (default: the trainer's)"),
         follow: bool = typer.Option(False, "--follow", help="then follow the job until it ends"),
         smoke: list[str] = typer.Option([], "--adapter-smoke-test", help="after the job: answer this prompt with "
                                         "the base model and with the new adapter, side by side (repeatable; "
                                         "follows the job)"),
         as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Queue a GRPO job: LoRA updates from groups of scored completions (group-relative
    advantages, clipped ratio, KL to the base model). The whole file is checked first."""
    if not file.is_file():
        fail(f"{file}: no such file")
    options = {"epochs": epochs, "lr": lr, "rank": rank, "alpha": alpha, "beta": beta, "clip": clip,
               "grad_accum": grad_accum, "seed": seed, "max_seq_len": max_seq_len}
    _queue("grpo", file, adapter, options, model, follow, as_json, "groups", "completion tokens", smoke)


@train_app.command("opd")
def opd(file: Path = typer.Option(..., "--file", "-f", help='JSONL: one {"prompt": [messages]} per line, which '
                                  'the student answers itself'),
        teacher: str = typer.Option(..., "--teacher", "-t", help="the teacher: a model of the library (the "
                                    "student's family, a larger one) or the http(s) URL of an OpenAI-compatible "
                                    "server that echoes log-probabilities (Kiln, vLLM)"),
        teacher_model: Optional[str] = typer.Option(None, "--teacher-model", help="the model name to send to a URL "
                                                    "teacher (its bearer key: KILN_TEACHER_API_KEY in the "
                                                    "daemon's environment)"),
        adapter: str = typer.Option(..., "--adapter", "-a", help="name of the adapter to make"),
        eval_file: Optional[Path] = typer.Option(None, "--eval-file", help="held-out prompts (same format): the "
                                                 "student's KL to the teacher on them is measured before and after"),
        samples: Optional[int] = typer.Option(None, "--samples", help="completions sampled per prompt and step "
                                              "(default 4)"),
        max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="longest sampled completion "
                                                     "(default 128)"),
        temperature: Optional[float] = typer.Option(None, "--temperature", help="the student's sampling "
                                                    "temperature (default 1)"),
        epochs: Optional[int] = typer.Option(None, "--epochs", help="passes over the prompts (default 1)"),
        lr: Optional[float] = typer.Option(None, "--lr", help="peak learning rate (default 2e-4)"),
        rank: Optional[int] = typer.Option(None, "--rank", help="LoRA rank (default 16)"),
        alpha: Optional[float] = typer.Option(None, "--alpha", help="LoRA alpha (default 32)"),
        grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="prompts per optimizer step (default 1)"),
        seed: Optional[int] = typer.Option(None, "--seed", help="sampling, shuffling and initialisation seed"),
        max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="longest prompt + completion, tokens "
                                                  "(default 512)"),
        model: Optional[str] = typer.Option(None, "--model", "-m", help="the student (default: the trainer's model)"),
        follow: bool = typer.Option(False, "--follow", help="then follow the job until it ends"),
        smoke: list[str] = typer.Option([], "--adapter-smoke-test", help="after the job: answer this prompt with "
                                        "the base model and with the new adapter, side by side (repeatable)"),
        as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Queue an on-policy distillation job: the student samples answers to the prompts, the
    teacher scores every sampled token, and the LoRA learns to lower the student's reverse KL to
    the teacher on its own samples. The teacher is checked (same vocabulary) before anything runs."""
    for f in (file, eval_file):
        if f is not None and not f.is_file():
            fail(f"{f}: no such file")
    options = {"epochs": epochs, "lr": lr, "rank": rank, "alpha": alpha, "samples": samples,
               "max_new_tokens": max_new_tokens, "temperature": temperature, "grad_accum": grad_accum,
               "seed": seed, "max_seq_len": max_seq_len}
    _queue("opd", file, adapter, options, model, follow, as_json, "prompts", "tokens to sample at most", smoke,
           {"teacher": teacher, "teacher_model": teacher_model,
            "eval_file": str(eval_file.resolve()) if eval_file else None})


def _fmt_eta(s) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _line(job: dict) -> str:
    total = job.get("total_steps") or "?"
    loss = f"{job['loss']:.4f}" if job.get("loss") is not None else "-"
    tps = f"{job['tokens_per_s']:.0f}" if job.get("tokens_per_s") else "-"
    state = job["state"] + (" (cancelling)" if job.get("cancel_requested") and job["state"] in ("queued", "running") else "")
    grpo = f"  reward {job['reward']:.3f} |adv| {job.get('advantage_abs', 0):.3f} kl {job.get('kl', 0):.4f}" \
        if job.get("reward") is not None else f"  kl {job['kl']:.4f}" if job.get("kl") is not None else ""
    return (f"{job['id']:<10}{state:<22}{job['adapter']:<18}{str(job['step']) + '/' + str(total):>11}"
            f"{job['epoch']:>7}{loss:>10}{tps:>9}{_fmt_eta(job.get('eta_s')):>9}{grpo}")


HEADER = f"{'JOB':<10}{'STATE':<22}{'ADAPTER':<18}{'STEP':>11}{'EPOCH':>7}{'LOSS':>10}{'TOK/S':>9}{'ETA':>9}"


def _follow(c, job_id: str, as_json: bool) -> None:
    """Draw a progress bar with the loss until the job ends; exit 1 unless it completed."""
    since, first_loss = 0, None
    while True:
        job = _cmd(c, "train.job", {"id": job_id, "since": since})
        for rec in job["losses"]:
            since = rec["step"]
            first_loss = first_loss if first_loss is not None else rec["loss"]
            if as_json:
                typer.echo(json.dumps(rec))
        if not as_json and job.get("total_steps") and verbosity() >= 0:
            total = job["total_steps"]
            width = 30
            done = int(width * job["step"] / total)
            loss = f"{job['loss']:.4f}" if job["loss"] is not None else "-"
            sys.stderr.write(f"\r{job_id} [{'#' * done}{'.' * (width - done)}] {job['step']}/{total} "
                             f"epoch {job['epoch']} loss {loss} (start {first_loss if first_loss is None else round(first_loss, 4)}) "
                             f"{job['tokens_per_s'] or 0:.0f} tok/s ETA {_fmt_eta(job['eta_s'])}   ")
            sys.stderr.flush()
        if job["state"] in vocab.JOB_FINISHED:
            if verbosity() >= 0:
                sys.stderr.write("\n")
            if as_json:
                typer.echo(json.dumps({k: v for k, v in job.items() if k != "losses"}))
            else:
                before, after = job.get("held_out_kl_before"), job.get("held_out_kl_after")
                if before and after:
                    typer.echo(f"held-out KL to the teacher ({before['measure']}, per token): "
                               f"{before['kl']:.4f} before, {after['kl']:.4f} after")
                typer.echo(f"{job_id} {job['state']}" + (f": {job['error']}" if job.get("error") else "")
                           + (f" — adapter {job['adapter']} is ready (`kiln run --adapter {job['adapter']} …`)"
                              if job["state"] == "completed" else ""))
            if job["state"] != "completed":
                raise typer.Exit(1)
            return
        time.sleep(0.5)


@train_app.command("status")
def status(job: Optional[str] = typer.Argument(None, help="a job id (default: every job)"),
           follow: bool = typer.Option(False, "--follow", help="follow the job with a progress bar"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output")):
    """Training jobs: state, step/total, epoch, loss, tokens/s, ETA."""
    with _client() as c:
        if follow:
            if not job:
                jobs = [j for j in _cmd(c, "train.jobs")["jobs"] if j["state"] in ("queued", "running", "paused")]
                if not jobs:
                    fail("no job is queued or running")
                job = jobs[0]["id"]
            return _follow(c, job, as_json)
        if job:
            j = _cmd(c, "train.job", {"id": job})
            if as_json:
                typer.echo(json.dumps(j))
                return
            typer.echo(HEADER)
            typer.echo(_line(j))
            if j.get("error"):
                typer.echo(f"error: {j['error']}")
            return
        jobs = _cmd(c, "train.jobs")["jobs"]
        if as_json:
            typer.echo(json.dumps(jobs))
            return
        if not jobs:
            typer.echo("no training jobs (`kiln train sft --file F --adapter NAME` queues one)")
            return
        typer.echo(HEADER)
        for j in jobs:
            typer.echo(_line(j))


@train_app.command("cancel")
def cancel(job: str = typer.Argument(..., help="the job id")):
    """Cancel a queued or running job."""
    with _client() as c:
        j = _routed(c, "train.cancel", {"id": job})
        typer.echo(f"{j['id']}: cancel requested ({j['state']})")
