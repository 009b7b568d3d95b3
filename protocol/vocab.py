"""The words every Kiln process shares: worker states, job states, error codes.

One table each, so that the supervisor, the workers, the HTTP front end and the CLI never compare
strings of their own. An error code carries its HTTP status and whether retrying can help.
"""

from __future__ import annotations

from dataclasses import dataclass

# -- worker lifecycle, as the supervisor's process table sees it (supervisord's states) --------
STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, FATAL = "stopped", "starting", "running", "backoff", "stopping", "fatal"
PROCESS_STATES = (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, FATAL)
ALIVE = (STARTING, RUNNING, STOPPING)            # a process exists (or is about to)

# -- what a worker says of itself in hello and heartbeats --------------------------------------
BOOTING, LOADING, READY, BUSY = "booting", "loading", "ready", "busy"
WORKER_STATES = (BOOTING, LOADING, READY, BUSY)
WORKER_LOADING = (BOOTING, LOADING)              # alive, but cannot serve yet


def serving(process_state: str | None, worker_state: str | None) -> bool:
    """True when a worker can take a request now."""
    return process_state in (STARTING, RUNNING) and worker_state in (READY, BUSY)


# -- training and evaluation jobs --------------------------------------------------------------
QUEUED, JOB_RUNNING, PAUSED, COMPLETED, FAILED, CANCELLED = "queued", "running", "paused", "completed", "failed", "cancelled"
JOB_STATES = (QUEUED, JOB_RUNNING, PAUSED, COMPLETED, FAILED, CANCELLED)
JOB_FINISHED = (COMPLETED, FAILED, CANCELLED)


# -- error codes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorCode:
    code: str
    status: int               # the HTTP status a front end answers with
    retryable: bool = False   # may the same request succeed later, unchanged?


_CODES = [
    ErrorCode("bad_request", 400), ErrorCode("invalid_value", 400), ErrorCode("invalid_type", 400),
    ErrorCode("invalid_json", 400), ErrorCode("bad_data", 400), ErrorCode("bad_model", 400),
    ErrorCode("bad_teacher", 400),        # OPD: the teacher cannot score for this student (vocabulary, reach)
    ErrorCode("bad_suite", 400), ErrorCode("suite_not_found", 404), ErrorCode("no_supervisor", 500),
    ErrorCode("context_length_exceeded", 400), ErrorCode("adapter_mismatch", 400), ErrorCode("context_too_small", 400),
    ErrorCode("unsupported_model", 400), ErrorCode("model_not_found", 404), ErrorCode("unknown_worker", 404),
    ErrorCode("unknown_command", 400), ErrorCode("unknown_op", 400),
    ErrorCode("adapter_not_found", 404), ErrorCode("job_not_found", 404), ErrorCode("not_found", 404),
    ErrorCode("forbidden", 403), ErrorCode("invalid_api_key", 401),
    ErrorCode("adapter_exists", 409), ErrorCode("adapter_in_use", 409), ErrorCode("job_finished", 409),
    ErrorCode("body_too_large", 413),
    ErrorCode("cancelled", 499), ErrorCode("client_closed", 499),
    ErrorCode("op_failed", 500), ErrorCode("internal_error", 500),
    ErrorCode("worker_crashed", 502, retryable=True), ErrorCode("stage_state_lost", 502, retryable=True),
    ErrorCode("server_busy", 503, retryable=True), ErrorCode("worker_unavailable", 503, retryable=True),
    ErrorCode("worker_fatal", 503), ErrorCode("no_model", 503), ErrorCode("no_worker", 503),
    ErrorCode("shutting_down", 503, retryable=True), ErrorCode("model_loading", 503, retryable=True),
    ErrorCode("insufficient_memory", 503, retryable=True), ErrorCode("model_invalid", 400),
    ErrorCode("pinned", 409),
    ErrorCode("deadline_exceeded", 504, retryable=True), ErrorCode("timeout", 504, retryable=True),
]
ERRORS: dict[str, ErrorCode] = {e.code: e for e in _CODES}


def http_status(code: str | None) -> int:
    """The HTTP status of an error code; an unknown code is a server error."""
    e = ERRORS.get(code or "")
    return e.status if e else 500


def retryable(code: str | None) -> bool:
    e = ERRORS.get(code or "")
    return bool(e and e.retryable)
