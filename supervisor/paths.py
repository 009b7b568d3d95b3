"""Where Kiln keeps state (KILN_HOME, default ~/.kiln) and runtime files (sockets, key, pid).

Runtime files live in $XDG_RUNTIME_DIR/kiln, or <KILN_HOME>/run when KILN_HOME is set or there
is no XDG runtime dir; the folder is mode 0700. An ipc socket path must fit in 107 bytes, so a
deep KILN_HOME gets its sockets in a short /tmp folder named after it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

_SUN_PATH_MAX = 107


@dataclass(frozen=True)
class Paths:
    home: Path
    run: Path

    @classmethod
    def from_env(cls) -> "Paths":
        home = Path(os.environ.get("KILN_HOME") or Path.home() / ".kiln").expanduser().absolute()
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        run = home / "run" if (os.environ.get("KILN_HOME") or not xdg) else Path(xdg) / "kiln"
        if len(str(run / "workers.sock")) + len("ipc://") > _SUN_PATH_MAX:
            digest = hashlib.sha256(str(home).encode()).hexdigest()[:12]
            run = Path(tempfile.gettempdir()) / f"kiln-{os.getuid()}-{digest}"
        return cls(home, run)

    @property
    def logs(self) -> Path:
        return self.home / "logs"

    @property
    def pidfile(self) -> Path:
        return self.run / "kiln.pid"

    @property
    def lockfile(self) -> Path:
        return self.run / "kiln.lock"

    @property
    def keyfile(self) -> Path:
        return self.run / "hmac.key"

    @property
    def worker_keyfile(self) -> Path:
        """The key of the worker socket — a different key from the control socket's, so that a
        worker can sign its own messages but cannot speak on the control socket."""
        return self.run / "workers.key"

    @property
    def worker_endpoint(self) -> str:
        return f"ipc://{self.run / 'workers.sock'}"

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.run / 'control.sock'}"

    @property
    def daemon_log(self) -> Path:
        return self.logs / "kiln.log"

    def worker_log(self, name: str) -> Path:
        return self.logs / f"worker-{name}.log"

    def ensure(self) -> None:
        for d in (self.home, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run, 0o700)
