"""Private by default (issue 35): everything under KILN_HOME but model files is 0600/0700 —
what the daemon writes, and what an earlier Kiln left readable (fixed at start, with an event)."""

import os
import stat

import pytest

from daemon_harness import Daemon, spec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_the_daemon_makes_kiln_home_private_and_leaves_models_alone(tmp_path):
    home = tmp_path / "home"
    for d in ("train/jobs/j1", "sessions", "models", "eval"):
        (home / d).mkdir(parents=True)
    os.chmod(home, 0o755)
    readable = [home / "train/jobs/j1/data.jsonl", home / "sessions/chat.json", home / "eval/results.jsonl"]
    for f in readable:
        f.write_text("private")
        os.chmod(f, 0o644)
    for d in ("train", "train/jobs", "train/jobs/j1", "sessions", "eval", "models"):
        os.chmod(home / d, 0o755)          # whatever umask this process has (the CLI's tests set 077)
    model = home / "models" / "m.gguf"
    model.write_bytes(b"GGUF")
    os.chmod(model, 0o644)
    outside = tmp_path / "shared.txt"
    outside.write_text("not Kiln's")
    os.chmod(outside, 0o644)
    (home / "sessions" / "link").symlink_to(outside)       # a link: its target is not Kiln's to change
    with Daemon(home, {"a": spec()}) as d:
        d.wait_state("a", "running")
        for f in readable:
            assert mode(f) == 0o600, f
        for folder in (home, home / "train", home / "train/jobs/j1", home / "sessions", home / "eval"):
            assert mode(folder) == 0o700, folder
        assert mode(model) == 0o644 and mode(home / "models") == 0o755
        assert mode(outside) == 0o644
        # what the daemon itself wrote since
        for root, dirs, files in os.walk(home):
            if os.path.relpath(root, home).split(os.sep)[0] == "models":
                continue
            for f in files:
                p = os.path.join(root, f)
                if not os.path.islink(p) and p not in map(str, readable):
                    assert mode(p) & 0o077 == 0, (p, oct(mode(p)))
        log = home / "logs" / "kiln.log"
        assert mode(log) == 0o600 and "now 0600/0700" in log.read_text()
