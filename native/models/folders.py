"""Where Kiln keeps and looks for models: KILN_HOME/models, then each folder of KILN_MODEL_PATH."""

from __future__ import annotations

import os
from pathlib import Path


def kiln_home() -> Path:
    return Path(os.environ.get("KILN_HOME") or Path.home() / ".kiln")


def model_dirs() -> list[Path]:
    dirs = [kiln_home() / "models"]
    for entry in os.environ.get("KILN_MODEL_PATH", "").split(os.pathsep):
        if entry:
            dirs.append(Path(entry).expanduser())
    return dirs
