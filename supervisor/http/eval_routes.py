"""HTTP routes for evaluation (translations of the bus commands and the evaluator's ops):

    POST /v1/eval/run        {"suite" | "file" | "inline", "adapter"?, "adapters"?, "seed"?} → the queued job
                             (file: a file in KILN_HOME/data; inline: the suite itself)
    GET  /v1/eval/jobs       every job;   GET /v1/eval/jobs/{id}: one, with per-example results
    DELETE /v1/eval/jobs/{id}  cancel it
"""

from __future__ import annotations

import falcon

from .common import JSONError, action_body, bus, routed
from .request_paths import check_data_file

FIELDS = ("suite", "file", "inline", "adapter", "adapters", "seed", "replay_of")


class Eval:
    def __init__(self, sup, read_json):
        self.sup, self.read_json = sup, read_json

    def on_post_run(self, req, resp):
        body = self.read_json(req)
        unknown = set(body) - set(FIELDS)
        if unknown:
            raise JSONError(400, "invalid_value", f"unknown field(s) {sorted(unknown)}; known: {', '.join(FIELDS)}")
        if "file" in body:
            body["file"] = check_data_file(self.sup, body["file"])
        resp.media = routed(self.sup, "eval.submit", body)
        resp.status = falcon.HTTP_201

    def on_get_jobs(self, req, resp):
        resp.media = {"object": "list", "data": bus(self.sup, "eval.jobs")["jobs"]}

    def on_get_job(self, req, resp, job_id):
        resp.media = bus(self.sup, "eval.job", {"id": job_id})

    def on_delete_job(self, req, resp, job_id):
        action_body(req)
        resp.media = routed(self.sup, "eval.cancel", {"id": job_id}, 60)


def install(app: falcon.App, sup, read_json) -> None:
    ev = Eval(sup, read_json)
    app.add_route("/v1/eval/run", ev, suffix="run")
    app.add_route("/v1/eval/jobs", ev, suffix="jobs")
    app.add_route("/v1/eval/jobs/{job_id}", ev, suffix="job")
