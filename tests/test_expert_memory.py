"""Where the expert cache's slots live (native/expert_memory.py): the choice between the
supervisor's segment (warm restarts) and private memory (huge pages), from the system's
transparent-huge-page settings and the segment's tmpfs mount — given here as files."""


import pytest

from kiln.native.experts.memory import huge_page_bytes, place, private_buffer

SEG = "/dev/shm/kiln-0-abc-default"


def system(tmp_path, enabled="always [madvise] never", shmem="always within_size advise [never] deny force",
           dev_shm="rw,nosuid,nodev"):
    thp = tmp_path / "thp"
    thp.mkdir(exist_ok=True)
    (thp / "enabled").write_text(enabled + "\n")
    (thp / "shmem_enabled").write_text(shmem + "\n")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs /dev tmpfs rw 0 0\ntmpfs /dev/shm tmpfs {dev_shm} 0 0\n")
    return {"thp": thp, "mounts": mounts}


def test_auto_takes_private_huge_pages_when_shared_memory_has_none(tmp_path):
    p = place("auto", SEG, **system(tmp_path))
    assert (p.kind, p.huge_pages, p.warm_restart) == ("private", True, False)
    assert "cold" in p.why and "huge=" in p.why


@pytest.mark.parametrize("how", [{"dev_shm": "rw,nosuid,nodev,huge=within_size"},
                                 {"shmem": "always within_size advise never deny [force]"}])
def test_auto_keeps_the_segment_when_it_can_have_huge_pages(tmp_path, how):
    p = place("auto", SEG, **system(tmp_path, **how))
    assert (p.kind, p.huge_pages, p.warm_restart) == ("shared", True, True)


def test_auto_keeps_the_segment_when_no_memory_has_huge_pages(tmp_path):
    p = place("auto", SEG, **system(tmp_path, enabled="always madvise [never]"))
    assert (p.kind, p.huge_pages) == ("shared", False) and "neither" in p.why


def test_a_mount_huge_option_counts_only_for_the_mount_the_segment_is_on(tmp_path):
    s = system(tmp_path, dev_shm="rw")
    s["mounts"].write_text(s["mounts"].read_text() + "tmpfs /dev/shm/other tmpfs rw,huge=always 0 0\n"
                                                     "tmpfs /dev/sh tmpfs rw,huge=always 0 0\n")
    assert place("auto", SEG, **s).kind == "private"


def test_explicit_choices_are_kept_and_a_wrong_one_is_refused(tmp_path):
    s = system(tmp_path)
    assert place("shared", SEG, **s).kind == "shared" and not place("shared", SEG, **s).huge_pages
    assert place("private", SEG, **system(tmp_path, enabled="always madvise [never]", dev_shm="huge=always")).kind == "private"
    with pytest.raises(ValueError, match="'huge' is not one of auto, shared, private"):
        place("huge", SEG, **s)
    with pytest.raises(ValueError, match="needs the supervisor's segment"):
        place("shared", None, **s)


def thp_eligible(address: int) -> bool:
    """The kernel's own word (/proc/self/smaps THPeligible) on the mapping holding `address`."""
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


def test_private_memory_asks_for_huge_pages_where_the_system_gives_them():
    import numpy as np
    from kiln.native.experts.memory import anon_huge_pages
    buf = private_buffer(8 << 20)
    address = np.frombuffer(buf, np.uint8).ctypes.data
    assert thp_eligible(address) == anon_huge_pages()
    buf[:] = b"\1" * len(buf)
    held = huge_page_bytes(address)
    assert held is not None and held <= len(buf)                 # this mapping's, not the process's
    if anon_huge_pages():
        other = np.frombuffer(private_buffer(8 << 20, huge=False), np.uint8)
        other[:] = 1
        assert huge_page_bytes(other.ctypes.data) == 0
    del address
