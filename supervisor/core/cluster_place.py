"""Placing an on-demand model on a cluster's nodes (issue 41): on one node when one has room, else
split into pipeline stages over as few nodes as hold it together (native/stages.py), else not at
all — with the numbers. The placer (placer.py) asks; the Ray spawner (ray_spawner.py) knows the
nodes and their free memory."""

from __future__ import annotations

from .worker_config import _split

MAX_STAGES = 4             # past this the hops cost more than the model gains by running at all
GiB = 2**30


def stages_needed(need: int, free: list[int]) -> int:
    """1 when one node has `need` bytes free; N when the N freest nodes each hold an N-th of it
    (and no fewer do); 0 when no split up to MAX_STAGES fits."""
    free = sorted(free, reverse=True)
    for n in range(1, min(MAX_STAGES, len(free)) + 1):
        if free[n - 1] >= -(-need // n):
            return n
    return 0


def no_room(model: str, need: int, free: list[int]) -> str:
    nodes = ", ".join(f"{f / GiB:.2f}" for f in sorted(free, reverse=True)) or "none alive"
    return (f"{model} needs {need / GiB:.2f} GiB and no node of the cluster has that free, nor do up to "
            f"{MAX_STAGES} nodes together (free GiB per node: {nodes}); add a node (`ray start --address HEAD "
            f"--memory BYTES`) or unload a model")


def split_specs(name: str, spec: dict, count: int) -> dict[str, dict]:
    """The workers of a model run as `count` stages: `name` first, then name.stage1 …"""
    return _split(name, {**spec, "enabled": True}, count, 1)
