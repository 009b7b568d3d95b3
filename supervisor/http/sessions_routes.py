"""The chat sessions over HTTP — the conversations `kiln chat --session NAME` saves and the chat
page keeps (core/sessions.py): `GET /v1/sessions[?q=TEXT]`, `GET|PUT|DELETE /v1/sessions/NAME`,
`POST /v1/sessions/NAME/rename {"to": NEW}`. A stored conversation is checked field by field: it
is replayed into prompts and rendered in a page, so nothing unknown or oversized is kept."""

from __future__ import annotations

from .common import JSONError, action_body, parse_json

ROLES = ("system", "user", "assistant", "tool")
DOC_FIELDS = {"messages", "model", "adapter", "params", "title", "branched_from", "name", "created", "updated"}
MESSAGE_FIELDS = {"role", "content", "reasoning", "tool_calls", "tool_call_id", "stats"}
MAX_MESSAGES = 10_000


def _bad(field: str, message: str, code: str = "invalid_value") -> JSONError:
    return JSONError(400, code, message, param=field)


def _parts(content) -> bool:
    """OpenAI's content parts as the chat page keeps them: text, and images as data: URIs only (a
    session never holds an address the page would fetch)."""
    return isinstance(content, list) and 0 < len(content) <= 64 and all(
        isinstance(p, dict) and ((p.get("type") == "text" and isinstance(p.get("text"), str) and len(p) == 2) or (
            p.get("type") == "image_url" and len(p) == 2 and isinstance(p.get("image_url"), dict)
            and isinstance(p["image_url"].get("url"), str) and p["image_url"]["url"].startswith("data:image/")))
        for p in content)


def check_doc(name: str, doc) -> dict:
    """A session document as the page or an import sends it: 400 naming the first thing wrong."""
    if not isinstance(doc, dict):
        raise _bad("body", "a session is a JSON object: {messages: [...], model, params, title, …}", "invalid_type")
    for k in doc:
        if k not in DOC_FIELDS:
            raise _bad(k, f"unsupported field {k!r} in a session (supported: {', '.join(sorted(DOC_FIELDS))})",
                       "unsupported_field")
    if doc.get("name") not in (None, name):
        raise _bad("name", f"the document is session {doc['name']!r} but the URL names {name!r}; import it under "
                           f"one name (drop `name`)")
    msgs = doc.get("messages")
    if not isinstance(msgs, list) or len(msgs) > MAX_MESSAGES:
        raise _bad("messages", f"messages must be a list of at most {MAX_MESSAGES:,} messages", "invalid_type")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES or not (
                isinstance(m.get("content", ""), (str, type(None))) or _parts(m.get("content"))):
            raise _bad(where, f"{where} must be {{role: {'|'.join(ROLES)}, content: string or parts (text, and "
                              f"image_url ones holding a data:image/… URI)}}")
        extra = set(m) - MESSAGE_FIELDS
        if extra:
            raise _bad(where, f"{where} has unsupported field {sorted(extra)[0]!r} (supported: "
                              f"{', '.join(sorted(MESSAGE_FIELDS))})", "unsupported_field")
        if not isinstance(m.get("reasoning", ""), (str, type(None))) or not isinstance(m.get("tool_calls", []), (list, type(None))) \
                or not isinstance(m.get("stats", {}), (dict, type(None))):
            raise _bad(where, f"{where}: reasoning is a string, tool_calls a list, stats an object", "invalid_type")
    for k, t in (("model", str), ("adapter", str), ("title", str), ("params", dict), ("branched_from", dict),
                 ("created", (int, float)), ("updated", (int, float))):
        if doc.get(k) is not None and (not isinstance(doc[k], t) or isinstance(doc[k], bool)):
            raise _bad(k, f"{k} has the wrong type", "invalid_type")
    params = doc.get("params") or {}
    for k, v in params.items():
        if not isinstance(k, str) or len(k) > 64 or not (v is None or isinstance(v, (int, float, str)) and not isinstance(v, bool)):
            raise _bad("params", f"params.{k}: a sampling value is a number or a string", "invalid_type")
    return {k: v for k, v in doc.items() if k not in ("name", "updated")}


class SessionsRoute:
    def __init__(self, sup):
        self.sup = sup

    def _store(self):
        from ..core.sessions import Sessions
        return Sessions(self.sup.paths.home)

    def _call(self, fn, *args):
        from ..core.sessions import SessionError
        try:
            return fn(*args)
        except SessionError as e:
            status = 404 if str(e).startswith("no session") else 400
            raise JSONError(status, "session_not_found" if status == 404 else "invalid_value", str(e)) from None

    def on_get(self, req, resp):
        q = req.get_param("q")
        store = self._store()
        resp.media = {"object": "list", "data": store.search(q) if q else store.list()}

    def on_get_one(self, req, resp, name):
        doc = self._call(self._store().load, name)
        if doc is None:
            raise JSONError(404, "session_not_found", f"no session named {name!r} (GET /v1/sessions lists them)")
        resp.media = {**doc, "name": name}

    def on_put_one(self, req, resp, name):
        limit = self.sup.cfg["server"]["max_body_bytes"]
        raw = req.bounded_stream.read(limit + 1)
        if len(raw) > limit:
            raise JSONError(413, "body_too_large", f"a session over server.max_body_bytes = {limit}")
        store = self._store()
        doc = check_doc(name, parse_json(raw))
        old = self._call(store.load, name) or {}
        self._call(store.save, name, {**doc, "created": doc.get("created") or old.get("created")})
        resp.media = {**store.load(name), "name": name}

    def on_delete_one(self, req, resp, name):
        self._call(self._store().remove, name)
        resp.media = {"deleted": name}

    def on_post_rename(self, req, resp, name):
        body = action_body(req, ("to",))
        to = body.get("to")
        if not isinstance(to, str) or not to:
            raise _bad("to", "rename takes {\"to\": NEW_NAME}")
        self._call(self._store().rename, name, to)
        resp.media = {"renamed": name, "to": to}


def install(app, sup) -> None:
    route = SessionsRoute(sup)
    app.add_route("/v1/sessions", route)
    app.add_route("/v1/sessions/{name}", route, suffix="one")
    app.add_route("/v1/sessions/{name}/rename", route, suffix="rename")
