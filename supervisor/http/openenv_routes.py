"""HTTP routes for the OpenEnv runs the daemon owns (the evaluator plays them: workers/openenv_runs.py):

    POST   /v1/openenv/runs                 {"env", groups?, group_size?, seed?, max_steps?, temperature?,
                                             max_tokens?, model?, adapter?, train?, eval_seeds?} → the queued run
                                             (adapter: train it with GRPO on the returns, then compare it with
                                             the base model on eval_seeds held-out seeds)
    GET    /v1/openenv/runs                 every run
    GET    /v1/openenv/runs/{id}            one, with its summary and evaluation
    DELETE /v1/openenv/runs/{id}            cancel it (what was recorded is kept)
    POST   /v1/openenv/runs/{id}/resume     go on with a cancelled or failed run from its last whole episode
    GET    /v1/openenv/runs/{id}/artifacts/{name}[?folder=rollout|eval-base|eval-adapter]
                                            summary.json, transcript.jsonl, dataset.jsonl, discovery.json,
                                            evaluation.json — as written
"""

from __future__ import annotations

import falcon

from .common import JSONError, action_body, bus, routed
from .request_paths import check_model_ref

FIELDS = ("env", "groups", "group_size", "seed", "max_steps", "temperature", "max_tokens", "model", "adapter",
          "train", "eval_seeds")


class OpenEnvRuns:
    def __init__(self, sup, read_json):
        self.sup, self.read_json = sup, read_json

    def on_post_runs(self, req, resp):
        body = self.read_json(req)
        unknown = set(body) - set(FIELDS)
        if unknown:
            raise JSONError(400, "invalid_value", f"unknown field(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
        if not isinstance(body.get("env"), str) or not body["env"]:
            raise JSONError(400, "invalid_value", "env is required: the OpenEnv server's URL, e.g. "
                            "http://127.0.0.1:8000", param="env")
        if body.get("model"):
            body["model"] = check_model_ref(self.sup, body["model"])
        bus(self.sup, "openenv.preflight", {"adapter": body.get("adapter")})
        resp.media = routed(self.sup, "openenv.start", body)
        resp.status = falcon.HTTP_201

    def on_get_runs(self, req, resp):
        resp.media = {"object": "list", "data": bus(self.sup, "openenv.runs")["runs"]}

    def on_get_run(self, req, resp, run_id):
        resp.media = bus(self.sup, "openenv.run", {"id": run_id})

    def on_delete_run(self, req, resp, run_id):
        action_body(req)
        resp.media = routed(self.sup, "openenv.cancel", {"id": run_id}, 60)

    def on_post_resume(self, req, resp, run_id):
        action_body(req)
        resp.media = routed(self.sup, "openenv.resume", {"id": run_id}, 60)

    def on_get_artifact(self, req, resp, run_id, name):
        where = bus(self.sup, "openenv.artifact", {"id": run_id, "name": name,
                                                   "folder": req.get_param("folder") or "rollout"})
        resp.content_type = "application/json" if name.endswith(".json") else "application/jsonl"
        resp.stream = open(where["path"], "rb")
        resp.content_length = where["bytes"]


def install(app: falcon.App, sup, read_json) -> None:
    runs = OpenEnvRuns(sup, read_json)
    app.add_route("/v1/openenv/runs", runs, suffix="runs")
    app.add_route("/v1/openenv/runs/{run_id}", runs, suffix="run")
    app.add_route("/v1/openenv/runs/{run_id}/resume", runs, suffix="resume")
    app.add_route("/v1/openenv/runs/{run_id}/artifacts/{name}", runs, suffix="artifact")
