"""A worker kind for tests/test_liveness.py: ops that keep the main thread from the GIL, as a
long tokenization once did — computing (CPU time advances) or blocked (it does not)."""

import ctypes
import os
import time

from kiln.workers.runtime import main
from kiln.workers.worker import Worker, op


def _first_time(req) -> bool:
    """False when the body's `once` file exists (the router's retry after a kill returns at once)."""
    path = req.body.get("once")
    if not path:
        return True
    if os.path.exists(path):
        return False
    open(path, "w").close()
    return True


class LivenessWorker(Worker):
    kind = "test"

    @op("compute_holding_gil")
    def compute_holding_gil(self, req):
        """Compute for about `seconds` in one C call: no bytecode boundary at which the heartbeat
        thread could take the GIL."""
        if not _first_time(req):
            return {"done": False}
        per_million = 1.0
        for _ in range(3):                # the fastest of three: a run cut by preemption misleads
            t0 = time.perf_counter()
            sum(range(1_000_000))
            per_million = max(min(per_million, time.perf_counter() - t0), 1e-4)
        sum(range(int(1_000_000 * req.body["seconds"] / per_million)))
        return {"done": True}

    @op("block_holding_gil")
    def block_holding_gil(self, req):
        """Sleep `seconds` holding the GIL (a PyDLL call keeps it): silent, and no CPU used."""
        if not _first_time(req):
            return {"done": False}
        ctypes.PyDLL(None).usleep(int(req.body["seconds"] * 1e6))
        return {"done": True}


if __name__ == "__main__":
    main(LivenessWorker)
