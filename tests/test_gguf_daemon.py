"""Hostile model files in the library, asked about over HTTP (issue 35): 200 mutants of a real
model, each planned by the supervisor (GET /v1/models/M/plan, what the dashboard asks for every
library model) and read by /api/show — every answer a 4xx or a plan, none a 5xx or a hang, the
supervisor's memory unchanged within 50 MB, and the worker beside it never restarted."""

import random
import time

import psutil
import pytest

from conftest import tiny_path
from daemon_harness import Daemon, http_json, spec
from test_gguf_fuzz import mutants

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SEED, COUNT = 35, 200


def test_200_hostile_model_files_leave_the_supervisor_as_it_was(tmp_path):
    data = tiny_path("llama").read_bytes()
    rng = random.Random(SEED)
    made = list(mutants(data, rng, n_edges=200, n_cuts=40, n_flips=60))[:COUNT]
    assert len(made) == COUNT
    (tmp_path / "models").mkdir()
    names = []
    for i, (what, raw) in enumerate(made):
        (tmp_path / "models" / f"m{i:03d}.gguf").write_bytes(raw)
        names.append((f"m{i:03d}", what))
    with Daemon(tmp_path, {"a": spec()}) as d:
        d.wait_state("a", "running")
        sup = psutil.Process(d.status()["daemon"]["pid"])
        http_json(d, "GET", "/v1/models/m000/plan")           # warm: the plan code's first import
        rss0 = sup.memory_info().rss
        bad, slow, planned = [], [], []
        for name, what in names:
            for method, path, body in (("GET", f"/v1/models/{name}/plan", None),
                                       ("POST", "/api/show", {"model": name})):
                t0 = time.monotonic()
                status, answer = http_json(d, method, path, body)
                took = time.monotonic() - t0
                if status >= 500:
                    bad.append((name, what, path, status, str(answer)[:200]))
                if took > 10:
                    slow.append((name, what, path, round(took, 1)))
                if status == 200 and "plan" in path:
                    planned.append(name)
        grew = (sup.memory_info().rss - rss0) / 2**20
        print(f"{len(planned)} of {COUNT} mutants planned; supervisor RSS {rss0 / 2**20:.0f} MiB, grew {grew:.1f} MiB")
        assert not bad, bad[:10]
        assert not slow, slow[:10]
        assert grew < 50
        # a mutant whose header plans is loaded on demand by a request: its worker refuses the file
        # at boot (exit 3, fatal at once — no restart loop) and the request says why
        for name in planned[:4]:
            t0 = time.monotonic()
            status, answer = http_json(d, "POST", "/v1/chat/completions",
                                       {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert time.monotonic() - t0 < 30
            assert status == 200 or status == 400 and answer["error"]["code"] == "model_invalid", (name, answer)
            if status == 400:           # and the same answer once its worker is known to be fatal
                again = http_json(d, "POST", "/v1/chat/completions",
                                  {"model": name, "messages": [{"role": "user", "content": "x"}]})
                assert again[0] == 400 and again[1]["error"]["code"] == "model_invalid", again
        a = d.worker("a")
        assert a["state"] == "running" and a["restarts"] == 0
