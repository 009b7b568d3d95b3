"""The one place the supervisor's layers meet: the daemon (core) with its bus commands and its HTTP
front end. `kiln up` runs what this makes; everything else imports only in its own direction
(tests/test_layering.py)."""

from __future__ import annotations

from .bus import commands, eval_commands, model_commands, openenv_commands, train_commands  # noqa: F401  (they register bus commands)
from .core.config import Config
from .core.daemon import Supervisor
from .core.paths import Paths
from .http.app import serve_http


def make_supervisor(config: Config, paths: Paths) -> Supervisor:
    return Supervisor(config, paths, front_end=serve_http)
