"""HTTP routes for training jobs and adapters (translations of the bus commands):

    POST   /v1/train/sft             {"data" | "file", "adapter", options…, "model"?} → the queued job
                                     (data: JSONL text; file: a file in KILN_HOME/data)
    POST   /v1/train/grpo            the same for GRPO (scored groups; options beta, clip too)
    POST   /v1/train/opd             on-policy distillation: prompts, "teacher" (a library model or an
                                     http(s) URL, "teacher_model" its name there), "eval_file"/"eval_data"
                                     (held-out prompts); options samples, max_new_tokens, temperature too
    GET    /v1/train/jobs            every job
    GET    /v1/train/jobs/{id}       one job with its loss history (?since=STEP)
    DELETE /v1/train/jobs/{id}       cancel it
    GET    /v1/adapters              registered adapters and the active one
    GET    /v1/adapters/{name}       one adapter
    POST   /v1/adapters/{name}/load  make it active;   POST /v1/adapters/unload: none active
    DELETE /v1/adapters/{name}       delete it (409 while active or in use)
"""

from __future__ import annotations

import hashlib
import os

import falcon

from .common import JSONError, action_body, bus, routed
from .request_paths import check_data_file, check_model_ref, data_dir

OPTIONS = ("epochs", "lr", "rank", "alpha", "targets", "max_seq_len", "checkpoint_interval", "seed",
           "grad_accum", "warmup", "schedule", "weight_decay", "betas")
GRPO_OPTIONS = OPTIONS + ("beta", "clip")
OPD_OPTIONS = OPTIONS + ("samples", "max_new_tokens", "temperature")
OPD_FIELDS = ("teacher", "teacher_model", "eval_file", "eval_data")


class Train:
    def __init__(self, sup, read_json):
        self.sup, self.read_json = sup, read_json

    def on_post_sft(self, req, resp):
        self._submit(req, resp, "sft", OPTIONS)

    def on_post_grpo(self, req, resp):
        self._submit(req, resp, "grpo", GRPO_OPTIONS)

    def on_post_opd(self, req, resp):
        self._submit(req, resp, "opd", OPD_OPTIONS)

    def _submit(self, req, resp, method: str, names: tuple):
        body = self.read_json(req)
        if not isinstance(body.get("adapter"), str) or not body["adapter"]:
            raise JSONError(400, "invalid_value", "adapter is required (a string)", param="adapter")
        fields = {"file", "data", "adapter", "model", "options"} | (set(OPD_FIELDS) if method == "opd" else set())
        unknown = set(body) - set(names) - fields
        if unknown:
            raise JSONError(400, "invalid_value", f"unknown field(s) {sorted(unknown)}; options: {', '.join(names)}")
        if ("file" in body) == ("data" in body):
            raise JSONError(400, "invalid_value", "give the training data as data (JSONL text, one example a line) "
                            f"or file (a file in {data_dir(self.sup)})", param="data")
        if not isinstance(body.get("options", {}), dict):
            raise JSONError(400, "invalid_type", "options must be an object", param="options")
        file = check_data_file(self.sup, body["file"]) if "file" in body else self._upload(body["data"])
        options = dict(body.get("options") or {}, **{k: body[k] for k in names if k in body})
        work = {"file": file, "adapter": body["adapter"], "options": options, "method": method}
        if body.get("model"):
            work["model"] = check_model_ref(self.sup, body["model"])
        if method == "opd":
            work.update(self._opd_fields(body))
        resp.media = routed(self.sup, "train.submit", work)
        resp.status = falcon.HTTP_201

    def _opd_fields(self, body: dict) -> dict:
        teacher = body.get("teacher")
        if not isinstance(teacher, str) or not teacher:
            raise JSONError(400, "invalid_value", "teacher is required: a model of the library, or the http(s) URL "
                            "of an OpenAI-compatible server (with teacher_model, the name it serves)", param="teacher")
        out = {"teacher": teacher if teacher.startswith(("http://", "https://"))
               else check_model_ref(self.sup, teacher, "teacher")}
        if body.get("teacher_model") is not None:
            if not isinstance(body["teacher_model"], str) or len(body["teacher_model"]) > 256:
                raise JSONError(400, "invalid_value", "teacher_model must be a name (a string)", param="teacher_model")
            out["teacher_model"] = body["teacher_model"]
        if "eval_file" in body and "eval_data" in body:
            raise JSONError(400, "invalid_value", "give held-out prompts as eval_data or eval_file, not both",
                            param="eval_data")
        if "eval_file" in body:
            out["eval_file"] = check_data_file(self.sup, body["eval_file"], "eval_file")
        elif "eval_data" in body:
            out["eval_file"] = self._upload(body["eval_data"], "eval_data")
        return out

    def _upload(self, data, field: str = "data") -> str:
        """JSONL sent in the request, kept as a private file in KILN_HOME/data/uploads (named by its
        hash: the same data sent twice is one file), which the trainer reads as any data file."""
        if not isinstance(data, str) or not data.strip():
            raise JSONError(400, "invalid_value", f"{field} must be JSONL text (one example a line)", param=field)
        raw = data.encode("utf-8", "strict")
        folder = data_dir(self.sup) / "uploads"
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"{hashlib.sha256(raw).hexdigest()[:32]}.jsonl"
        if not path.exists():
            tmp = path.with_suffix(".part")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)
        return str(path)

    def on_get_jobs(self, req, resp):
        resp.media = {"object": "list", "data": bus(self.sup, "train.jobs")["jobs"]}

    def on_get_job(self, req, resp, job_id):
        resp.media = bus(self.sup, "train.job", {"id": job_id, "since": req.get_param_as_int("since") or 0})

    def on_delete_job(self, req, resp, job_id):
        action_body(req)
        resp.media = routed(self.sup, "train.cancel", {"id": job_id}, 60)


class Adapters:
    def __init__(self, sup):
        self.sup = sup

    def on_get(self, req, resp):
        r = bus(self.sup, "adapters.list")
        resp.media = {"object": "list", "active": r["active"], "data": r["adapters"]}

    def on_get_one(self, req, resp, name):
        found = [a for a in bus(self.sup, "adapters.list")["adapters"] if a["name"] == name]
        if not found:
            raise JSONError(404, "adapter_not_found", f"no adapter named {name!r}")
        resp.media = found[0]

    def on_post_action(self, req, resp, name, action):
        if action != "load":
            raise JSONError(404, "not_found", f"no action {action!r} (POST /v1/adapters/{{name}}/load)")
        action_body(req)
        resp.media = bus(self.sup, "adapters.load", {"name": name})

    def on_post_unload(self, req, resp):
        action_body(req)
        resp.media = bus(self.sup, "adapters.unload")

    def on_delete_one(self, req, resp, name):
        action_body(req)
        resp.media = bus(self.sup, "adapters.delete", {"name": name})


def install(app: falcon.App, sup, read_json) -> None:
    train = Train(sup, read_json)
    app.add_route("/v1/train/sft", train, suffix="sft")
    app.add_route("/v1/train/grpo", train, suffix="grpo")
    app.add_route("/v1/train/opd", train, suffix="opd")
    app.add_route("/v1/train/jobs", train, suffix="jobs")
    app.add_route("/v1/train/jobs/{job_id}", train, suffix="job")
    adapters = Adapters(sup)
    app.add_route("/v1/adapters", adapters)
    app.add_route("/v1/adapters/unload", adapters, suffix="unload")
    app.add_route("/v1/adapters/{name}", adapters, suffix="one")
    app.add_route("/v1/adapters/{name}/{action}", adapters, suffix="action")
