"""The command bus: every action on the daemon is a named command here.

The CLI (over the control socket), the HTTP routes (in-process) and signal handlers all
dispatch through `run(supervisor, name, args)`; front ends only translate. A command's
docstring is its documentation. Commands run on the supervisor's loop thread.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import psutil

from kiln.protocol.vocab import WORKER_LOADING, http_status

from ..core import policy
from ..core.registry import CommandError, command

def _worker(sup, args) -> Any:
    name = args.get("name")
    if name not in sup.workers:
        raise CommandError("unknown_worker", f"no worker named {name!r} "
                           f"(workers: {', '.join(sup.workers) or 'none'})", status=404)
    return sup.workers[name]


def _targets(sup, args) -> list:
    return list(sup.workers.values()) if args.get("name") == "all" else [_worker(sup, args)]


@command("status")
def status(sup, args):
    """The daemon and every worker: state, pid, uptime, restarts, last exit, memory, CPU."""
    now = time.time()
    return {
        "daemon": {"pid": os.getpid(), "uptime_s": round(now - sup.started_at, 3),
                   "http": list(sup.http_address) if sup.http_address else None,
                   "home": str(sup.paths.home), "shutting_down": sup.shutting_down},
        "workers": [w.describe(now) for w in sup.workers.values()],
        "router": {"pending": len(sup.router.pending), "waiting": sup.router.waiting(), **sup.router.counts,
                   "sent": dict(sup.router.sent)},
        "cluster": sup.cluster_status(),
        "events": sup.events.since(0, int(args.get("events", 50))),
    }


@command("events", off_loop=True)
def events(sup, args):
    """Events after sequence number `after` (0: the last `limit`): worker started, exited,
    fatal, requests retried, jobs. `wait` seconds (≤ 30) waits for the next one."""
    after, limit = int(args.get("after") or 0), int(args.get("limit") or 200)
    wait = min(float(args.get("wait") or 0), 30.0)
    got = sup.events.wait(after, wait) if wait > 0 else sup.events.since(after)
    return {"events": got[-limit:] if after == 0 else got[:limit], "last": sup.events.last_seq}


@command("route")
def route(sup, args):
    """Which worker serves a model (`model`, default: the default model) — without waiting."""
    from ..core.routing import RouteError, Target
    try:
        w = sup.router.resolve(Target(model=args.get("model")))
    except RouteError as e:
        raise CommandError(e.code, e.message, status=http_status(e.code)) from None
    return {"worker": w.name, "state": w.ps.state, "worker_state": w.worker_state, "reason": w.ps.reason,
            "bad_model_file": sup.router.bad_model_file(w),
            "model": w.status.get("model") or w.spec.get("model"), "n_ctx": w.status.get("n_ctx")}


@command("worker")
def worker(sup, args):
    """One worker's status."""
    return _worker(sup, args).describe(time.time())


def system_info(sup) -> dict:
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    disks = {}
    models = sup.paths.home / "models"
    for label, path in (("state", sup.paths.home), ("models", models if models.exists() else sup.paths.home)):
        try:
            du = shutil.disk_usage(path)
            disks[label] = {"path": str(path), "free_bytes": du.free, "total_bytes": du.total}
        except OSError:
            pass
    return {"ram_total_bytes": vm.total, "ram_available_bytes": vm.available,
            "swap_total_bytes": sw.total, "swap_used_bytes": sw.used,
            "cpu_count": psutil.cpu_count(logical=True),
            "cpu_physical": psutil.cpu_count(logical=False),
            "load_avg": list(os.getloadavg()), "disk": disks}


@command("health", off_loop=True)
def health(sup, args):
    """The daemon's own readiness, with every worker's state and what is wrong:
    ok — every enabled worker runs; degraded — some do not, but the daemon serves (200 either way,
    as a load balancer must keep sending to a daemon that answers); unavailable (503) — shutting
    down, or no configured worker running (models loaded on demand do not count: one that went
    fatal leaves the daemon serving the rest)."""
    reasons = []
    workers = {}
    placed = set(sup.placer.loaded) if sup.placer is not None else set()
    configured = [w for w in sup.workers.values() if w.name not in placed and w.spec.get("enabled", True)]
    serving = not configured or any(w.ps.state == "running" for w in configured)
    for w in sup.workers.values():
        ws = w.status.get("state")
        workers[w.name] = {"state": w.ps.state, "worker_state": ws, "pid": w.pid, "rss_bytes": w.rss}
        if "expert_cache" in w.status:
            workers[w.name]["expert_cache"] = w.status["expert_cache"]
        if not w.spec.get("enabled", True) and w.ps.state == "stopped":
            continue
        if w.ps.state != "running":
            reasons.append(f"worker {w.name} is {w.ps.state}" + (f": {w.ps.reason}" if w.ps.reason else ""))
        elif ws in WORKER_LOADING:
            reasons.append(f"worker {w.name}: loading model")
    if sup.shutting_down:
        reasons.insert(0, "shutting down")
    elif not serving:
        reasons.insert(0, "no configured worker is running")
    status = "ok" if not reasons else "unavailable" if sup.shutting_down or not serving else "degraded"
    return {"status": status, "reasons": reasons, "workers": workers,
            "protocol": {"bad_frames": dict(sup.bad_frames), "bad_frames_total": sum(sup.bad_frames.values()),
                         "refused_keys": sup.keys.refused if sup.keys is not None else 0},
            "pending_requests": len(sup.pending), "system": system_info(sup)}


@command("restart")
def restart(sup, args):
    """Restart a worker (or `all`); also revives a fatal one."""
    for w in _targets(sup, args):
        sup.record("restart_requested", w.name, "")
        sup.apply(w, policy.Restart())
    return {"ok": True}


@command("stop")
def stop(sup, args):
    """Stop a worker (or `all`); it stays stopped until started."""
    for w in _targets(sup, args):
        sup.apply(w, policy.Stop())
    return {"ok": True}


@command("start")
def start(sup, args):
    """Start a stopped or fatal worker (or `all`)."""
    for w in _targets(sup, args):
        sup.apply(w, policy.Start(manual=True))
    return {"ok": True}


@command("config")
def config(sup, args):
    """Every effective setting with its source (default, file, env, cli)."""
    return sup.cfg.as_dict()


@command("shutdown")
def shutdown(sup, args):
    """Refuse new requests, let the ones in flight finish (up to `drain` seconds, default
    supervisor.drain_timeout), then stop every worker (shutdown → SIGTERM → SIGKILL) and exit."""
    if sup.shutting_down and sup.drain_until is not None and args.get("drain") == 0:
        sup.record("shutdown", None, f"{args.get('reason', 'requested')}: cutting the requests in flight now")
        sup.stop_everything()
    if not sup.shutting_down:
        sup.shutting_down = True
        sup.record("shutdown", None, args.get("reason", "requested"))
        drain = args.get("drain")
        drain = sup.cfg["supervisor"]["drain_timeout"] if drain is None else float(drain)
        sup.router.close()
        if drain > 0 and sup.router.pending:
            sup.drain_until = time.monotonic() + drain
            sup.record("draining", None, f"{len(sup.router.pending)} request(s) in flight: waiting up to {drain:g} s "
                                         f"for them to finish; new ones are refused")
        else:
            sup.stop_everything()
    left = max(0.0, sup.drain_until - time.monotonic()) if sup.drain_until is not None else 0.0
    return {"ok": True, "pid": os.getpid(), "draining": len(sup.router.pending) if left else 0,
            "drain_s": round(left, 1)}


@command("ping")
def ping(sup, args):
    """Is the daemon alive?"""
    return {"pong": True, "pid": os.getpid()}
