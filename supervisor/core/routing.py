"""What a request is, to the router: its target, its client, its pending state, and the ops
each front end and worker may name — the vocabulary shared by the router (router.py), the
control socket (sockets.py) and the command bus."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Callable

from kiln.protocol import Message, new_id

MAX_ATTEMPTS = 3                  # a request that produced nothing is sent at most this often
MODEL_KINDS = ("inference", "moe-stream")

# Ops a front end may name, and how each is routed: to a model's worker, or to a kind's.
MODEL_OPS = ("generate", "score", "embed", "rerank", "tokenize", "detokenize", "apply_template", "info", "slots")
MODEL_RUNS = ("generate", "score", "embed", "rerank")     # ops that run the model (and take an adapter)
KIND_OPS = {"train.submit": ("trainer", "train_submit"), "train.cancel": ("trainer", "job_cancel"),
            "eval.submit": ("evaluator", "eval_submit"), "eval.register": ("evaluator", "eval_register"),
            "eval.cancel": ("evaluator", "job_cancel"), "openenv.start": ("evaluator", "openenv_submit"),
            "openenv.resume": ("evaluator", "openenv_resume"), "openenv.cancel": ("evaluator", "job_cancel")}
ROUTED_OPS = MODEL_OPS + tuple(KIND_OPS)

# What a worker may ask the router for (anything else is `forbidden`).
WORKER_ALLOWED: dict[str, frozenset] = {
    "evaluator": frozenset({"generate", "score", "tokenize", "detokenize", "apply_template", "info",
                            "train.submit", "train.cancel"}),     # an OpenEnv run trains its adapter
    "trainer": frozenset(),
    # the first stage of a split model sends its rows to the later stages (workers/stage.py)
    "inference": frozenset({"stage_forward"}),
}


@dataclass(frozen=True)
class Target:
    worker: str | None = None     # a worker by name
    model: str | None = None      # a model (worker name, model stem or spec); None: the default
    kind: str | None = None       # the first enabled worker of a kind


@dataclass
class Client:
    """Where a request's messages go. `deliver` gets messages whose id is the client's own id."""
    id: str
    deliver: Callable[[Message], None]
    origin: str = "local"          # "http" | "control" | "worker:<name>" — for logs
    # shows nothing before the reply (a non-streamed HTTP answer): output it got may be dropped
    # (a "restart" message) and the request run again when its worker dies
    replayable: bool = False
    # told which worker took the request (an "admitted" message before any other): the HTTP
    # front end names the model in its answer and logs without asking the loop a second time
    wants_admission: bool = False


@dataclass
class Pending:
    id: str                        # the router's id, as the worker sees it
    op: str
    body: Any
    client: Client
    target: Target
    deadline: float                # monotonic: the request's whole life
    timeout: float                 # seconds, for messages
    wait_until: float              # monotonic: the longest it may wait for a worker
    worker: str | None = None      # where it is running now (None: waiting)
    target_worker: str = ""        # the worker its target resolved to at admission
    got_output: bool = False
    attempts: int = 0
    adapter: str | None = None
    retried_after: list = field(default_factory=list)   # why it was sent again (shown in the reply)
    keep_alive: Any = "default"    # seconds its model stays loaded after it (None: forever)
    min_ctx: int | None = None     # the context the client asked for (Ollama's num_ctx): a worker
                                   # whose context is shorter refuses it
    buffers: list = field(default_factory=list)    # raw frames it carries (a stage's rows)


class RouteError(Exception):
    def __init__(self, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after = code, message, retry_after


def routed_target(op: str, body: Any) -> tuple[str, Any, Target]:
    """A routed op's worker op, body and target: model ops take an optional "model" (or
    "worker") from the body; job ops go to the worker of their kind."""
    body = dict(body) if isinstance(body, dict) else {}
    if op in KIND_OPS:
        kind, worker_op = KIND_OPS[op]
        return worker_op, body, Target(kind=kind)
    model, worker = body.pop("model", None), body.pop("worker", None)
    return op, body, Target(model=model if isinstance(model, str) else None,
                            worker=worker if isinstance(worker, str) else None)


@dataclass
class LocalCall:
    """A request from an in-process front end (HTTP): its messages arrive on `events`;
    `cancel` hands the cancel to the loop (`on_loop`)."""
    on_loop: Callable[[Callable[[], Any]], Any]
    cancel_client: Callable[[str, str], None]
    id: str = field(default_factory=new_id)
    events: queue.Queue = field(default_factory=queue.Queue)

    def cancel(self) -> None:
        self.on_loop(lambda: self.cancel_client(self.id, "http"))
