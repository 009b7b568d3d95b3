"""Never falls over, measured: N streaming clients against `kiln up` on the default model while
the inference worker is SIGKILLed every K seconds. Prints JSON: attempts, completions, the share
completed, how every stream ended, the worker's states, and the kill→serving-again times.

    python bench/chaos.py [--clients 8] [--seconds 60] [--kill-every 8] [--tokens 48]

Clients honour Retry-After. A stream that had started and was cut must end with an error event
and then [DONE]; the worker must never be `fatal`. tests/test_router_e2e.py runs a shorter one.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def one_stream(base: str, i: int, tokens: int) -> dict:
    """One streaming chat attempt: {status, done, error_event, finished, retry_after}."""
    host, port = base.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"messages": [{"role": "user", "content": f"Tell me a short story about lighthouse number {i}."}],
            "max_tokens": tokens, "temperature": 0.7, "seed": i, "stream": True}
    out = {"status": None, "done": False, "error_event": False, "finished": False, "retry_after": None}
    try:
        c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["retry_after"] = r.getheader("Retry-After")
            r.read()
            return out
        for line in r:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            ev = json.loads(data)
            if "error" in ev:
                out["error_event"] = True
            elif ev.get("choices") and ev["choices"][0].get("finish_reason"):
                out["finished"] = True
    except (OSError, http.client.HTTPException) as e:
        out["exception"] = f"{type(e).__name__}: {e}"
    finally:
        c.close()
    return out


def run_chaos(daemon, clients: int, seconds: float, kill_every: float, tokens: int) -> dict:
    """Drive `daemon` (a tests/daemon_harness.Daemon serving one inference worker named
    "default") with streaming clients while killing its worker; return the figures."""
    base = daemon.http
    stop = threading.Event()
    attempts: list[dict] = []
    lock = threading.Lock()
    restarts: list[float] = []
    states: set = set()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            r = one_stream(base, k * 10_000 + i, tokens)
            i += 1
            with lock:
                attempts.append(r)
            if r["retry_after"]:                                  # honour Retry-After (bounded)
                stop.wait(min(float(r["retry_after"]), 5.0))
            elif r["status"] is None:
                stop.wait(0.2)

    def watch_states() -> None:
        after = 0
        while not stop.is_set():
            got = daemon.command("events", {"after": after, "wait": 0.5})
            for e in got["events"]:
                if e["worker"] == "default":
                    states.add(e["event"])
            after = got["last"]

    def killer() -> None:
        first = time.monotonic()
        k = 0
        while True:                                   # on a fixed schedule: every kill_every s
            k += 1
            if stop.wait(max(0.0, first + k * kill_every - time.monotonic())):
                return
            pid = daemon.worker("default")["pid"]
            if not pid:
                continue
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while not stop.is_set():                 # serving again: a new pid, loaded and ready
                w = daemon.worker("default")
                if w["pid"] not in (None, pid) and w["worker_state"] in ("ready", "busy"):
                    restarts.append(time.monotonic() - t0)
                    break
                time.sleep(0.02)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    threads += [threading.Thread(target=killer, daemon=True), threading.Thread(target=watch_states, daemon=True)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(150)
    ok = [a for a in attempts if a["status"] == 200 and a["done"] and a["finished"] and not a["error_event"]]
    streams = [a for a in attempts if a["status"] == 200]
    return {
        "clients": clients, "seconds": seconds, "kill_every_s": kill_every, "tokens": tokens,
        "attempts": len(attempts), "completed": len(ok), "completed_share": round(len(ok) / max(1, len(attempts)), 3),
        "statuses": {str(s): sum(1 for a in attempts if a["status"] == s) for s in {a["status"] for a in attempts}},
        "streams_without_done": sum(1 for a in streams if not a["done"]),
        "streams_cut_with_error_event": sum(1 for a in streams if a["error_event"]),
        "cut_streams_missing_error_event": sum(1 for a in streams if a["done"] and not a["finished"]
                                               and not a["error_event"]),
        "exceptions": [a["exception"] for a in attempts if "exception" in a][:5],
        "kills": len(restarts), "kill_to_serving_s": [round(x, 3) for x in restarts],
        "kill_to_serving_median_s": round(statistics.median(restarts), 3) if restarts else None,
        "worker_events": sorted(states), "fatal": "fatal" in states,
        "daemon_alive": daemon.proc.poll() is None,
        "router": daemon.status()["router"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--kill-every", type=float, default=8.0)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--model", default="default")
    a = ap.parse_args()
    from daemon_harness import Daemon
    from kiln.native.models.library import resolve_model
    path = resolve_model(a.model, pull=(a.model == "default"))
    with tempfile.TemporaryDirectory() as home:
        # the daemon's own defaults for the restart policy; only the HTTP port is chosen for us
        with Daemon(Path(home), {"default": {"kind": "inference", "model": str(path)}},
                    supervisor={"heartbeat_interval": 1.0, "start_secs": 1.0, "backoff_initial": 0.5,
                                "backoff_max": 30.0, "max_restarts": 5, "restart_window": 60.0,
                                "graceful_timeout": 5.0},
                    server={"threads": max(16, 2 * a.clients)}) as d:
            d.wait(lambda st: st["workers"][0]["worker_state"] == "ready", timeout=120, what="model loaded")
            print(json.dumps(run_chaos(d, a.clients, a.seconds, a.kill_every, a.tokens), indent=1))


if __name__ == "__main__":
    main()
