"""Where Kiln keeps state (KILN_HOME, default ~/.kiln) and runtime files (sockets, key, pid).

Runtime files live in $XDG_RUNTIME_DIR/kiln, or <KILN_HOME>/run when KILN_HOME is set or there
is no XDG runtime dir; the folder is mode 0700. An ipc socket path must fit in 107 bytes, so a
deep KILN_HOME gets its sockets in a short /tmp folder named after it.
"""

from __future__ import annotations

import hashlib
import os
import stat
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

    def make_private(self) -> list[str]:
        """Everything under KILN_HOME that others could read (training data, eval results, chat
        sessions, logs) made 0600/0700 — model files and links aside (a model folder may be shared
        on purpose; a link's mode is its target's). Returns what was changed, for the log."""
        changed = []
        for root, dirs, files in os.walk(self.home):
            dirs[:] = [d for d in dirs if not (root == str(self.home) and d == "models")]
            for name, private in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
                p = os.path.join(root, name)
                try:
                    st = os.lstat(p)
                    if stat.S_ISLNK(st.st_mode) or name.endswith(".gguf") or not st.st_mode & 0o077:
                        continue
                    os.chmod(p, stat.S_IMODE(st.st_mode) & private)
                    changed.append(p)
                except OSError:
                    continue                     # gone meanwhile, or another user's: left as it is
        if self.home.exists() and stat.S_IMODE(self.home.stat().st_mode) & 0o077:
            os.chmod(self.home, 0o700)
            changed.append(str(self.home))
        return changed

    def ensure(self) -> None:
        for d in (self.home, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.run.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run, 0o700)
