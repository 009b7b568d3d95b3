"""A worker kind for the tests: it can be told to crash, hang, fail at boot, or stream N chunks.

Settings (in [workers.<name>.settings]): boot = "ok" | "fail" | "crash" | "slow" |
"crash_if_file" (crash while settings.file exists), boot_seconds (for "slow"). Run by the supervisor as `python -m kiln_test_worker` with tests/ on
PYTHONPATH.
"""

import os
import signal
import time

from kiln.workers.runtime import main
from kiln.workers.worker import BootError, Chunk, Worker, op


class TestWorker(Worker):
    kind = "test"

    def boot(self):
        mode = self.settings.get("boot", "ok")
        if mode == "fail":
            raise BootError("configured to fail at boot (settings.boot = 'fail')")
        if mode == "crash":
            os._exit(1)
        if mode == "crash_if_file" and os.path.exists(self.settings["file"]):
            os._exit(1)
        if mode == "slow":
            time.sleep(float(self.settings.get("boot_seconds", 2.0)))

    @op("echo")
    def echo(self, req):
        return {"value": req.body.get("value"), "pid": os.getpid(), "buffers": len(req.buffers)}

    @op("stream")
    def stream(self, req):
        size, delay = req.body.get("size", 0), req.body.get("delay", 0)
        for i in range(req.body["n"]):
            if delay:
                time.sleep(delay)
            yield Chunk({"i": i}, [bytes([i % 256]) * size] if size else [])
        return {"n": req.body["n"]}

    @op("crash")
    def crash(self, req):
        time.sleep(req.body.get("after", 0))
        code = req.body.get("code")
        if code is None:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code)

    @op("hang")
    def hang(self, req):
        end = time.time() + req.body.get("seconds", 3600)
        while time.time() < end and not req.cancelled():
            time.sleep(0.01)
        return {"cancelled": req.cancelled()}

    @op("block")
    def block(self, req):
        """Hold the worker until the file `release` exists (a test's way to pin a request in
        flight without sleeping); `started` is created once it runs."""
        open(req.body["started"], "w").close()
        while not os.path.exists(req.body["release"]):
            if req.cancelled():
                return {"released": False}
            time.sleep(0.01)
        return {"released": True}

    @op("ask_up")
    def ask_up(self, req):
        """Send a request up to the router, as the evaluator does; report what came back."""
        from kiln.workers.worker import OpError
        try:
            msgs = list(self.request_up(req.body["op"], req.body.get("body") or {}, timeout=30))
            return {"reply": msgs[-1].body}
        except OpError as e:
            return {"error": e.code, "message": e.message}

    @op("environ")
    def environ(self, req):
        return {"environ": dict(os.environ)}

    @op("sleep")
    def sleep(self, req):
        time.sleep(req.body["seconds"])
        return {"slept": req.body["seconds"]}


if __name__ == "__main__":
    main(TestWorker)
