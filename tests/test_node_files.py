"""Model files brought to a cluster's nodes (issue 41 item 3), fast tier: the supervisor's file
server hands out only the files it allowed, in bounded reads; a node's copy is checked against
the file's sha256 before it takes its name, and a copy that does not match is refused and
removed."""

from __future__ import annotations

import hashlib
import os

import pytest

from kiln.supervisor.core.node_files import CHUNK, FetchError, FileServer, fetch, local_copy


@pytest.fixture
def source(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(os.urandom(3 * 2**20 + 17))
    return p


def test_the_server_hands_out_only_what_it_allowed_within_bounds(source, tmp_path):
    s = FileServer()
    other = tmp_path / "secret"
    other.write_bytes(b"no")
    with pytest.raises(PermissionError, match="not a file this supervisor hands out"):
        s.read(str(source), 0, 10)
    assert s.allow(str(source)) == source.stat().st_size
    assert s.read(str(source), 5, 10) == source.read_bytes()[5:15]
    assert s.digest(str(source)) == hashlib.sha256(source.read_bytes()).hexdigest()
    for off, n in ((0, CHUNK + 1), (-1, 4), (source.stat().st_size + 1, 4), (0, 0)):
        with pytest.raises(ValueError, match="outside the file"):
            s.read(str(source), off, n)
    with pytest.raises(PermissionError):
        s.read(str(other), 0, 2)


def test_a_copy_is_checked_before_it_is_used_and_kept_once_checked(source, tmp_path):
    s = FileServer()
    size = s.allow(str(source))
    sha = s.digest(str(source))
    target = local_copy(str(tmp_path / "store"), "abcdef0123456789", str(source), sha)
    assert target.endswith(f"abcdef012345/{sha[:16]}-m.gguf")
    lines = []
    assert fetch(lambda at, n: s.read(str(source), at, n), size, sha, target, lines.append) == size
    assert open(target, "rb").read() == source.read_bytes() and lines
    assert fetch(lambda at, n: pytest.fail("a checked copy is not fetched again"), size, sha, target) == 0


@pytest.mark.parametrize("fault", ["tampered", "short"])
def test_a_copy_that_does_not_match_is_refused_and_removed(source, tmp_path, fault):
    data = source.read_bytes()

    def read(at, n):
        block = data[at:at + n]
        if fault == "tampered" and at == 0:
            block = b"X" + block[1:]
        if fault == "short":                                  # the source stops half way
            return block[:len(data) // 2 - at] if at < len(data) // 2 else b""
        return block
    sha = hashlib.sha256(data).hexdigest()
    target = str(tmp_path / "store" / "copy.gguf")
    with pytest.raises(FetchError, match="does not match its sha256" if fault == "tampered" else "ended at"):
        fetch(read, len(data), sha, target)
    assert [f for f in os.listdir(tmp_path / "store") if not f.endswith(".lock")] == []   # nothing half-written left
