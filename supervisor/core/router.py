"""The router: the one owner of every request's life between the front ends and the workers.

    submit ─► admitted (bounded) ─► waiting for a worker that can serve ─► sent ─► chunks… ─► reply
                  │ full: server_busy      │ deadline: worker_unavailable      │ worker died, nothing
                  ▼                        ▼ fatal/stopped: worker_fatal       ▼ produced yet: waiting again

Every front end — HTTP, the CLI over the control socket, a worker sending a request up — hands
a request to `submit` with a `Client` (where the answer goes) and a `Target` (which worker: by
name, by model, or by kind). The router chooses the worker, waits through its start or restart
up to `wait_for_worker` instead of answering 503, retries a request that produced nothing when
its worker died, applies the active adapter, and honours cancel and deadlines. 503 comes only
when the queue is full or the wait is over. It runs on the daemon's loop thread: no locks.

Workers may send requests up; `WORKER_ALLOWED` says which ops each kind may ask for.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import msgpack

from kiln.protocol import Message, make, new_id
from kiln.protocol.vocab import FATAL, retryable

from .process_table import ProcessTable, WorkerProcess
from .routing import (MAX_ATTEMPTS, MODEL_KINDS, MODEL_OPS, MODEL_RUNS,  # noqa: F401 (re-exported)
                      WORKER_ALLOWED, Client, LocalCall, Pending, RouteError, Target,
                      routed_target)

log = logging.getLogger("kiln.router")        # DEBUG lines: `kiln -v up`


class Router:
    def __init__(self, table: ProcessTable, send: Callable[[WorkerProcess, Message], None], *,
                 max_queue: int = 64, wait_for_worker: float = 60.0, request_timeout: float = 600.0,
                 adapters=None, record: Callable[[str, str | None, str], None] = lambda *a: None,
                 placer=None, on_loop: Callable[[Callable[[], Any]], Any] | None = None):
        """`on_loop(fn)` runs `fn` on the daemon's loop thread (the daemon's `submit`); the
        front ends' door, `request`, hands its work there."""
        self.table, self.send, self.record = table, send, record
        self.on_loop = on_loop or (lambda fn: fn())
        self.placer = placer             # models at run time (supervisor/placer.py); None: a fixed set
        self.fetch = None                # a hub model a request names, pulled first (core/hub_fetch.py)
        self.max_queue, self.wait_for_worker, self.request_timeout = max_queue, wait_for_worker, request_timeout
        self.adapters = adapters
        self.pending: dict[str, Pending] = {}
        self.closed = False
        self.counts = {"admitted": 0, "retried": 0, "busy": 0, "completed": 0, "failed": 0}
        self.sent: Counter = Counter()           # requests sent, by worker (copies share the load)

    # -- the front ends' door (any thread) -----------------------------------------------------

    def request(self, op: str, body: Any = None, timeout: float | None = None, replayable: bool = False,
                admission: bool = False) -> LocalCall:
        """A routed op (generate, score, tokenize, train.submit, …) from an in-process front end.
        The one method called off the loop: it checks the
        body can be sent, lets the placer plan on the caller's thread, and queues `submit`.
        `replayable`: the front end shows nothing before the reply, so a worker's death after
        output reruns the request (a "restart" message first) instead of failing it.
        `admission`: an "admitted" message (the worker that took it) comes first."""
        c = LocalCall(self.on_loop, self.cancel_client)
        worker_op, body, target = routed_target(op, body)
        client = Client(c.id, c.events.put, "http", replayable, admission)
        if not self._sendable(body, client):
            return c
        if target.model and self.placer is not None:
            if self.fetch is not None and (err := self.fetch.ensure(target.model)):
                self._error(client, "model_not_found", err)
                return c
            self.placer.prepare(target.model)          # here, on the caller's thread: not on the loop
        self.on_loop(lambda: self.submit(worker_op, body, client, target, timeout))
        return c

    def _sendable(self, body: Any, client: Client) -> bool:
        """Whether `body` can cross the wire; if not, the caller is answered at once. A body that
        cannot be packed would otherwise fail on the loop thread, after the caller began waiting."""
        try:
            msgpack.packb(body, use_bin_type=True)
            return True
        except (TypeError, ValueError, OverflowError) as e:   # UnicodeEncodeError is a ValueError
            self._error(client, "bad_request", f"the request holds a value that cannot be sent to a worker "
                        f"({type(e).__name__}: {str(e)[:200]})")
            return False

    # -- admission (the loop) -------------------------------------------------------------------

    def submit(self, op: str, body: Any, client: Client, target: Target,
               timeout: float | None = None, buffers: list | None = None) -> str | None:
        """Admit a request; its answer (or error) goes to `client`. Returns the router's id, or
        None when it was refused at once (the error was delivered)."""
        try:
            if self.closed:
                raise RouteError("shutting_down", "kiln is shutting down")
            if len(self.pending) >= self.max_queue:
                self.counts["busy"] += 1
                raise RouteError("server_busy", f"server busy: {len(self.pending)} requests are queued or "
                                 f"running (server.max_queue = {self.max_queue}); retry later", retry_after=1)
            keep_alive = self._keep_alive(op, body)
            if keep_alive != "default":
                body = {k: v for k, v in body.items() if k != "keep_alive"}
            min_ctx = body.get("min_ctx") if isinstance(body, dict) and op in MODEL_OPS else None
            if min_ctx is not None:
                if isinstance(min_ctx, bool) or not isinstance(min_ctx, int) or min_ctx <= 0:
                    raise RouteError("invalid_value", f"min_ctx must be a positive integer (a context in tokens), "
                                     f"got {str(min_ctx)[:40]!r}")
                body = {k: v for k, v in body.items() if k != "min_ctx"}
            w = self.resolve(target)            # unknown worker or model: a clear error now (or it loads)
            if target.worker is None or target.worker == w.spec.get("group"):
                w = self._least_busy(w)
            body, adapter = self._adapter(op, w, body)
        except RouteError as e:
            self._error(client, e.code, e.message, e.retry_after)
            return None
        now = self.table.clock.monotonic()
        timeout = timeout or self.request_timeout
        p = Pending(new_id(), op, body, client, target, now + timeout, timeout,
                    now + min(timeout, self.wait_for_worker), adapter=adapter, target_worker=w.name,
                    keep_alive=keep_alive, min_ctx=min_ctx, buffers=buffers or [])
        self.pending[p.id] = p
        self.counts["admitted"] += 1
        log.debug("admitted %s %s for %s (%d pending)", p.op, p.id, w.name, len(self.pending))
        if client.wants_admission:
            client.deliver(make("admitted", id=client.id, worker=w.name,
                                model=w.status.get("model") or w.spec.get("model")))
        self._try_send(p, now)
        return p.id

    def resolve(self, target: Target) -> WorkerProcess:
        """The worker a target names, or RouteError (unknown worker, model not served)."""
        table = self.table
        if target.worker is not None:
            if target.worker not in table:
                raise RouteError("unknown_worker", f"no worker named {target.worker!r} "
                                 f"(workers: {', '.join(w.name for w in table) or 'none'})")
            return table[target.worker]
        if target.kind is not None:
            ws = [w for w in table if w.kind == target.kind]
            enabled = [w for w in ws if w.spec.get("enabled", True)] or ws
            if not enabled:
                raise RouteError("no_worker", f"no {target.kind} worker is configured; add [workers.{target.kind}] "
                                 f"kind = \"{target.kind}\" to kiln.toml (the default configuration has one)")
            return enabled[0]
        ws = [w for w in table if w.kind in MODEL_KINDS and not self._unloading(w)]
        if target.model is None and self.placer is not None and self.placer.active:
            return self._place(self.placer.active)
        if not ws:
            if self.placer is not None and target.model is not None:
                return self._place(target.model)
            raise RouteError("no_model", "no model is loaded and the request names none (name a model, "
                             "`kiln activate MODEL`, kiln up --model M, or [workers.NAME] kind = \"inference\")")
        if target.model is None:
            return next((w for w in ws if w.spec.get("enabled", True)), ws[0])
        for w in ws:
            if target.model in (w.name, w.status.get("model"), w.spec.get("model")):
                return w
        if self.placer is not None:
            return self._place(target.model)
        raise RouteError("model_not_found", f"model {target.model!r} is not served here (models: "
                         f"{', '.join(w.name for w in ws)}; GET /v1/models)")

    def bad_model_file(self, w: WorkerProcess) -> bool:
        """A model loaded on demand whose worker refused its file at boot (exit 3): the request
        named a file that cannot run — the client's 400, not the server's 503."""
        return (w.ps.state == FATAL and self.placer is not None and w.name in self.placer.loaded
                and not self.placer.loaded[w.name].pinned
                and (w.ps.last_exit or {}).get("code") == 3)

    def _unloading(self, w: WorkerProcess) -> bool:
        l = self.placer.loaded.get(w.name) if self.placer is not None else None
        return bool(l and l.unloading)

    def _place(self, model: str) -> WorkerProcess:
        from .placer import PlaceError
        try:
            return self.placer.place(model)
        except PlaceError as e:
            raise RouteError(e.code, e.message, e.retry_after) from None

    @staticmethod
    def _keep_alive(op: str, body: Any):
        if op not in MODEL_RUNS or not isinstance(body, dict) or "keep_alive" not in body:
            return "default"
        from .units import parse_duration
        try:
            return parse_duration(body["keep_alive"])
        except ValueError as e:
            raise RouteError("invalid_value", str(e)) from None

    def _least_busy(self, w: WorkerProcess) -> WorkerProcess:
        """Among a worker's copies ([workers.X] replicas), one that can serve with the least
        outstanding work; `w` itself when it has none."""
        group = w.spec.get("group")
        if not group:
            return w
        copies = [x for x in self.table if x.spec.get("group") == group and not self.table.gone_for_good(x)]
        return min(copies, key=lambda x: (not x.can_serve(), self.busy(x.name), x.name != w.name), default=w)

    def busy(self, worker: str) -> int:
        """Requests admitted for `worker` and not answered yet."""
        return sum(1 for p in self.pending.values() if p.target_worker == worker)

    def _adapter(self, op: str, w: WorkerProcess, body: Any) -> tuple[Any, str | None]:
        """The active adapter applies to generate/score unless the request names one ("" = none)."""
        if op not in MODEL_RUNS or w.kind not in MODEL_KINDS or not isinstance(body, dict) \
                or self.adapters is None:
            return body, None
        adapter = body.get("adapter")
        if adapter is None:
            adapter = self.adapters.active()
            if adapter:
                body = {**body, "adapter": adapter}
        elif adapter:
            try:
                self.adapters.get(adapter)
            except (KeyError, ValueError, LookupError) as e:
                raise RouteError("adapter_not_found", str(e).strip("'\"")) from None
        return body, adapter or None

    # -- sending and waiting --------------------------------------------------------------------

    def _try_send(self, p: Pending, now: float) -> bool:
        if p.target_worker not in self.table:      # cannot happen: a busy worker is never unloaded
            self._finish(p, "worker_unavailable", f"worker {p.target_worker} was unloaded")
            return False
        w = self.table[p.target_worker]
        if not w.can_serve() and w.spec.get("group") and p.target.worker != w.name:
            alt = self._least_busy(w)           # its copy died or is loading: another copy takes it
            if alt.can_serve():
                p.target_worker, w = alt.name, alt
        if w.can_serve() or (w.identity is not None and w.ps.state in ("starting", "running")
                             and p.op not in MODEL_RUNS):
            # non-generate ops queue inside a loading worker's executor; generation waits here,
            # so that a request never sits in a worker that may still fail to load
            n_ctx = w.status.get("n_ctx")
            if p.min_ctx is not None and isinstance(n_ctx, int) and p.min_ctx > n_ctx:
                self._finish(p, "context_too_small", f"the request asks for a {p.min_ctx}-token context "
                             f"(num_ctx), but {w.name} runs with {n_ctx}; set [models] ctx (or the worker's settings.ctx) "
                             f"and reload it")
                return False
            p.worker = w.name
            p.attempts += 1
            self.sent[w.name] += 1
            self.send(w, make("request", id=p.id, op=p.op, body=p.body, buffers=p.buffers,
                              deadline=self.table.clock.time() + max(0.0, p.deadline - now)))
            return True
        if self.table.gone_for_good(w):
            why = w.ps.reason or w.ps.state
            if self.bad_model_file(w):
                self._finish(p, "model_invalid", f"model {w.name} cannot be loaded: {why}")
                return False
            fix = f"`kiln restart {w.name}`" + (" after fixing its configuration" if w.ps.state == FATAL else "")
            self._finish(p, "worker_fatal" if w.ps.state == FATAL else "worker_unavailable",
                         f"worker {w.name} is {w.ps.state}: {why}; {fix}")
            return False
        if now >= p.wait_until:
            self._finish(p, "worker_unavailable",
                         f"worker {w.name} did not become ready within {self.wait_for_worker:g} s "
                         f"(it is {w.ps.state}" + (f", {w.worker_state}" if w.worker_state else "") + ")",
                         retry_after=2)
        return False

    def pump(self) -> None:
        """Send what waits for a worker that can now serve; expire deadlines. Called by the loop."""
        now = self.table.clock.monotonic()
        for p in list(self.pending.values()):
            if p.id not in self.pending:
                continue
            if now > p.deadline:
                self._cancel_on_worker(p)
                self._finish(p, "deadline_exceeded", f"the request took longer than its deadline ({p.timeout:g} s)")
            elif p.worker is None:
                self._try_send(p, now)

    def waiting(self) -> int:
        return sum(1 for p in self.pending.values() if p.worker is None)

    # -- worker traffic -----------------------------------------------------------------------

    def on_worker_message(self, w: WorkerProcess, msg: Message) -> None:
        p = self.pending.get(msg.id)
        if p is None or p.worker != w.name:
            return                     # cancelled, expired or retried elsewhere: late traffic is expected
        if msg.type == "chunk":
            p.got_output = True
            p.client.deliver(self._for_client(p, msg))
            return
        if msg.type == "error" and (not p.got_output or p.client.replayable) \
                and msg.get("code") == "shutting_down" and p.attempts < MAX_ATTEMPTS:
            self._rerun(p, w, "the worker stopped")      # wait for its successor
            return
        del self.pending[p.id]
        self.counts["completed" if msg.type == "reply" else "failed"] += 1
        log.debug("%s %s %s on %s %s", p.op, p.id, msg.type, w.name, msg.get("code") or "")
        self._used(p)
        p.client.deliver(self._for_client(p, msg))

    def _used(self, p: Pending) -> None:
        if self.placer is not None and p.op in MODEL_RUNS:
            self.placer.touch(p.target_worker, p.keep_alive)

    def _rerun(self, p: Pending, w: WorkerProcess, what: str, reason: str | None = None) -> None:
        """Send `p` again once a worker can take it; a client that got output drops it first."""
        had_output, p.got_output = p.got_output, False
        reason = reason or what
        if had_output:
            p.client.deliver(make("restart", id=p.client.id, reason=reason))
        p.worker = None
        p.retried_after.append(reason)
        self.counts["retried"] += 1
        log.debug("retry %s %s: %s", p.op, p.id, reason)
        self.record("request_retried", w.name, f"{p.op} {p.id}: {what} "
                    + ("after output its client had not shown yet" if had_output else "before any output"))

    def on_worker_exit(self, w: WorkerProcess, how: str) -> None:
        """A worker died: its requests that produced nothing — or whose client has shown nothing
        yet (replayable) — wait for the restart and run again; the others end with worker_crashed."""
        for p in list(self.pending.values()):
            if p.worker != w.name:
                continue
            if (not p.got_output or p.client.replayable) and p.attempts < MAX_ATTEMPTS:
                self._rerun(p, w, f"the worker died ({how})", how)
            else:
                self._finish(p, "worker_crashed", f"worker {w.name} died ({how}) during the request"
                             + (" after it had produced output" if p.got_output else f" ({p.attempts} attempts)"))

    def on_worker_request(self, w: WorkerProcess, msg: Message, deliver: Callable[[Message], None]) -> None:
        """A request a worker sends up on its own socket, checked against its kind's allow-list."""
        op = msg.get("op")
        client = Client(msg.id, deliver, f"worker:{w.name}")
        if op not in WORKER_ALLOWED.get(w.kind, frozenset()):
            allowed = ", ".join(sorted(WORKER_ALLOWED.get(w.kind, ()))) or "nothing"
            self._error(client, "forbidden", f"worker {w.name} ({w.kind}) may not ask for {op!r} (allowed: {allowed})")
            return
        worker_op, body, target = routed_target(op, msg.body)   # job ops (train.submit) go to their kind
        dl = msg.get("deadline")
        timeout = max(1.0, dl - self.table.clock.time()) if isinstance(dl, (int, float)) else None
        self.submit(worker_op, body, client, target, timeout, msg.buffers)

    # -- cancel and endings -------------------------------------------------------------------

    def cancel(self, rid: str, notify: bool = False) -> None:
        p = self.pending.get(rid)
        if p is None:
            return
        self._cancel_on_worker(p)
        del self.pending[rid]
        self._used(p)
        if notify:
            self._error(p.client, "cancelled", "cancelled")

    def cancel_client(self, client_id: str, origin: str) -> None:
        for p in list(self.pending.values()):
            if p.client.id == client_id and p.client.origin == origin:
                self.cancel(p.id)

    def _cancel_on_worker(self, p: Pending) -> None:
        if p.worker is not None and p.worker in self.table:
            w = self.table[p.worker]
            if w.identity:
                self.send(w, make("cancel", id=p.id))

    def close(self) -> None:
        """Admit nothing more; the requests in flight go on (a draining shutdown)."""
        self.closed = True

    def fail_all(self, code: str, message: str) -> None:
        self.closed = True
        for p in list(self.pending.values()):
            self._cancel_on_worker(p)
            self._finish(p, code, message)

    def _finish(self, p: Pending, code: str, message: str, retry_after: float | None = None) -> None:
        self.pending.pop(p.id, None)
        self._used(p)
        self.counts["failed"] += 1
        log.debug("%s %s failed: %s %s", p.op, p.id, code, message)
        self._error(p.client, code, message, retry_after)

    @staticmethod
    def _error(client: Client, code: str, message: str, retry_after: float | None = None) -> None:
        extra = {"retry_after": retry_after} if retry_after is not None else {}
        client.deliver(make("error", id=client.id, code=code, message=message, retryable=retryable(code), **extra))

    @staticmethod
    def _for_client(p: Pending, msg: Message) -> Message:
        fields = {k: v for k, v in msg.header.items() if k not in ("type", "id", "ts")}
        if msg.type == "reply" and p.worker:
            fields["worker"] = p.worker
            if p.retried_after:
                fields["retried_after"] = p.retried_after
        return make(msg.type, id=p.client.id, body=msg.body, buffers=msg.buffers, **fields)
