"""`rollwise bench load --switch` (issue 42, item 2's benchmark): its arms are switches of a real pool slot, each
served by the tier it is named after.

- the rig's three jobs load from the memory, disk and remote tier respectively once their first (remote) loads
  filled the tiers, and the engine a disk-tier switch built holds the pushed weights bit for bit;
- a memory-tier switch reads no disk: with every flat checkpoint deleted it is still served from memory, while the
  disk job's switch (its file gone) falls back to the remote tier: it did read the disk;
- the section's JSON carries the goal (full load / memory-tier switch) computed from its own medians.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from rollwise.bench.load import add_switch
from rollwise.bench.load_switch import ARM_NAMES, FULL_LOAD, SWITCH_GOAL, SwitchRig, run_switch_bench
from rollwise.model.loading import load_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory):
    model, tokenizer = load_model("tiny:0")
    rig = SwitchRig("tiny:0", model, tokenizer, tmp_path_factory.mktemp("disk-tier"), max_num_seqs=2,
                    max_model_len=32)
    yield rig, model
    rig.close()


def test_each_job_is_served_by_its_own_tier(rig):
    rig, model = rig
    assert [rig.switch(t)[0] for t in ("memory", "disk", "remote")] == ["remote"] * 3  # first loads fill the tiers
    for _ in range(2):
        for tier in ("memory", "disk", "remote"):
            served, seconds = rig.switch(tier)
            assert served == tier and seconds > 0
            if tier == "disk":  # the engine built from the flat checkpoint holds the pushed weights
                engine = rig.pool.slots[0].instances["disk"]
                held = dict(engine.model.named_parameters())
                for name, tensor in model.state_dict().items():
                    if name in held:
                        assert torch.equal(held[name], tensor), name
    cache = rig.pool.state()["model_cache"]
    assert cache["memory"]["hits"] == 2 and cache["disk"]["hits"] == 2 and cache["remote"]["hits"] == 5
    assert len(cache["memory"]["entries"]) == 1 and len(cache["disk"]["entries"]) == 2


def test_a_memory_tier_switch_reads_no_disk(rig):
    rig, _ = rig
    rig.switch("remote")  # the slot holds another job: the next two are loads
    for flat in [p for p in rig.disk_dir.iterdir() if p.is_dir()]:
        shutil.rmtree(flat)
    assert rig.switch("memory")[0] == "memory"
    assert rig.switch("disk")[0] == "remote"  # its flat checkpoint was read, found gone: the job's store served it


def test_the_section_reports_its_goal_from_its_medians():
    section = run_switch_bench(quick=True, repeats=1, specs=["tiny:0"], progress=lambda _: None, max_num_seqs=2,
                               max_model_len=32)
    case = section["models"]["tiny:0"]["page_cache"]
    assert set(case["arms"]) == {*ARM_NAMES.values(), FULL_LOAD}
    ratio = case["arms"][FULL_LOAD]["seconds"] / case["arms"][ARM_NAMES["memory"]]["seconds"]
    assert case["memory_vs_full_load"] == pytest.approx(ratio, rel=1e-2)
    result: dict = {"quick": True}
    add_switch(result, section)
    assert result["goals"]["switch_memory_vs_full_load"] == case["memory_vs_full_load"]
    assert result["goals"]["targets"]["switch_memory_vs_full_load"] == SWITCH_GOAL
    assert result["goals"]["met"]["switch_memory_vs_full_load"] == (case["memory_vs_full_load"] >= SWITCH_GOAL)
