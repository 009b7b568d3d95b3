"""llama-server's slot routes: `GET /slots` (a model's sequences: which are busy, what each
holds) and `POST /slots/{id}?action=save|restore|erase` with `{"filename": …}` — a slot's KV
cache kept in a file of the worker's `slot_save_path` and brought back, as llama-server's
clients (and its --slot-save-path) use them. The worker does the work (workers/slots.py);
`?model=` names another model's worker."""

from __future__ import annotations

from .openai_validate import bad, known_fields
from .pipeline import Pipeline
from .work import model_of

ACTIONS = ("save", "restore", "erase")


class Slots:
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def _model(self, req) -> dict:
        model = model_of({"model": req.get_param("model")})
        return {"model": model} if model else {}

    def on_get(self, req, resp):
        out, _ = self.pipe.call(req, "slots", {"action": "list", **self._model(req)})
        resp.media = [{"id": s["id"], "n_ctx": out["n_ctx"], "is_processing": s["is_processing"],
                       "tokens_cached": s["tokens_cached"]} for s in out["slots"]]

    def on_post_one(self, req, resp, id_slot: str):
        action = req.get_param("action")
        if action not in ACTIONS:
            raise bad("action", f"action must be one of {', '.join(ACTIONS)} (?action=save)")
        if not id_slot.isdigit():
            raise bad("id_slot", f"slot id {id_slot!r} is not a number")
        body = self.pipe.read_json(req) if req.content_length else {}
        known_fields(body, {"filename"} if action != "erase" else set())
        work = {"action": action, "id": int(id_slot), **self._model(req)}
        if action != "erase":
            if not isinstance(body.get("filename"), str):
                raise bad("filename", "filename is required: the file in the worker's slot_save_path", "invalid_type")
            work["filename"] = body["filename"]
        out, _ = self.pipe.call(req, "slots", work, timeout=600, param="filename")
        resp.media = out


def install(app, pipe: Pipeline) -> None:
    slots = Slots(pipe)
    app.add_route("/slots", slots)
    app.add_route("/slots/{id_slot}", slots, suffix="one")
