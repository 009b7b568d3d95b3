"""Foundation numbers, as JSON: restart latency after SIGKILL, request round trip through the
supervisor over loopback ipc, and the daemon's idle CPU.

    python bench/supervisor.py [--requests 10000] [--kills 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemon_harness import Daemon, spec  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--kills", type=int, default=5)
    args = ap.parse_args()
    out: dict = {"benchmark": "supervisor"}
    with tempfile.TemporaryDirectory() as home:
        d = Daemon(Path(home), {"a": spec(), "b": spec()},
                   supervisor={"heartbeat_interval": 1.0, "backoff_initial": 0.0, "start_secs": 0.0}).start()
        try:
            d.wait_state("a", "running")
            d.wait_state("b", "running")
            # 1. SIGKILL -> the replacement's hello (the daemon's own event timestamps)
            restarts = []
            for _ in range(args.kills):
                old = d.worker("a")["pid"]
                t0 = time.time()
                os.kill(old, signal.SIGKILL)
                d.wait(lambda st: next(w for w in st["workers"] if w["name"] == "a")["pid"] not in (None, old)
                       and any(e["event"] == "hello" and e["worker"] == "a" and e["ts"] > t0 for e in st["events"]),
                       timeout=30, what="replacement hello")
                hello = max(e["ts"] for e in d.status()["events"] if e["event"] == "hello" and e["worker"] == "a")
                restarts.append(hello - t0)
                d.wait_state("a", "running")
            out["sigkill_to_hello_ms"] = {"median": round(statistics.median(restarts) * 1000, 1),
                                          "min": round(min(restarts) * 1000, 1), "max": round(max(restarts) * 1000, 1),
                                          "runs": len(restarts)}
            # 2. round trip: control client -> supervisor -> worker echo -> back
            with d.client() as c:
                for _ in range(200):
                    list(c.call("b", "echo", {"value": 1}))
                lat = []
                for _ in range(args.requests):
                    t = time.perf_counter()
                    list(c.call("b", "echo", {"value": 1}))
                    lat.append(time.perf_counter() - t)
            out["round_trip_us"] = {"p50": round(pct(lat, 0.5) * 1e6, 1), "p99": round(pct(lat, 0.99) * 1e6, 1),
                                    "requests": len(lat)}
            # 3. idle CPU of the daemon process (workers heartbeating once a second)
            p = psutil.Process(d.proc.pid)
            p.cpu_percent(None)
            time.sleep(10)
            out["daemon_idle_cpu_percent"] = round(p.cpu_percent(None), 2)
            out["worker_idle_cpu_percent"] = round(psutil.Process(d.worker("b")["pid"]).cpu_percent(1.0), 2)
        finally:
            d.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
