"""An on-demand model on a cluster's nodes (issue 41 item 4, fast tier, fake spawner and plans):
one node when one has room, else split into pipeline stages over as few nodes as hold it
together — started, counted and unloaded as one — else refused with every node's free memory."""

from __future__ import annotations

import pytest

from test_placer import GiB, Rig
from kiln.supervisor.core.cluster_place import MAX_STAGES, stages_needed


def test_stages_needed_is_the_fewest_nodes_that_hold_the_model_together():
    assert stages_needed(2 * GiB, [3 * GiB, 1 * GiB]) == 1
    assert stages_needed(2 * GiB, [1 * GiB, 1 * GiB, 0]) == 2
    assert stages_needed(3 * GiB, [1 * GiB] * 3) == 3
    assert stages_needed(3 * GiB, [2 * GiB, 1 * GiB]) == 0          # two halves of 1.5 do not fit
    assert stages_needed(5 * GiB, [1 * GiB] * 8) == 0 and MAX_STAGES < 5
    assert stages_needed(1, []) == 0


def test_a_model_no_node_holds_runs_split_over_two_and_unloads_as_one():
    r = Rig(budget=10 * GiB)
    r.spawner.obeys_sigterm = False                                  # each exits when the test says
    r.placer.nodes_free = lambda: [int(1.5 * GiB), int(1.2 * GiB), GiB // 2]
    r.ask("c1", "medium")                                            # plans 2 GiB
    assert sorted(w.name for w in r.table) == ["medium", "medium.stage1"]
    front, stage = r.table["medium"], r.table["medium.stage1"]
    assert front.spec["settings"]["stage"] == [0, 2] and front.spec["settings"]["stages"] == ["medium.stage1"]
    assert stage.kind == "stage" and stage.spec["settings"]["stage"] == [1, 2] and stage.pid
    assert r.placer.loaded["medium"].planned_bytes == GiB and r.placer.used_bytes() == 2 * GiB
    assert any("in 2 stages" in d for e, _, d in r.events if e == "model_loading")
    r.hello_all()
    r.tick()
    r.answer_all()
    assert r.got["c1"][-1].type == "reply"
    r.placer.unload("medium", "test")
    r.spawner.last("medium").exit(0)
    r.tick()
    assert "medium" in r.table                                        # its stage still runs: kept together
    r.spawner.last("medium.stage1").exit(0)
    r.tick()
    assert not list(r.table) and not r.placer.loaded


def test_a_model_one_node_holds_is_not_split():
    r = Rig(budget=10 * GiB)
    r.placer.nodes_free = lambda: [3 * GiB, GiB]
    r.ask("c1", "medium")
    assert [w.name for w in r.table] == ["medium"] and "stage" not in r.table["medium"].spec["settings"]


def test_a_model_no_nodes_hold_together_is_refused_with_their_free_memory():
    r = Rig(budget=100 * GiB)
    r.placer.nodes_free = lambda: [GiB // 2, GiB // 4]
    r.ask("c1", "medium")
    err = r.got["c1"][-1]
    assert err.type == "error" and err.get("code") == "insufficient_memory"
    assert "0.50, 0.25" in err.get("message") and not list(r.table)
