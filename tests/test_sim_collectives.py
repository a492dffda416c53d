"""The simulator charges the sharded trainer's collectives (issue 18): FSDP2 all-gathers and
reduce-scatters over the trainer GPUs, at NVLink bandwidth inside a node and InfiniBand across."""

from __future__ import annotations

from pathlib import Path

import yaml

import rollwise
from rollwise.sim.cost import CollectiveModel, TrainerModel

CONFIGS = Path(rollwise.__file__).parent / "sim" / "configs"


def _model(**kw) -> CollectiveModel:
    return CollectiveModel(**{"model_bytes": 15.2e9, "intra_node_gbps": 350.0, "inter_node_gbps": 40.0, **kw})


def test_ring_time_follows_the_link_a_rank_crosses():
    c = _model()
    assert c.ring_s(1.0, 1) == 0.0  # one rank: nothing to gather
    inside, across = c.ring_s(1.0, 8), c.ring_s(1.0, 16)
    assert inside == 15.2e9 * 7 / 8 / 350e9
    assert across == 15.2e9 * 15 / 16 / 40e9 and across > 8 * inside  # crossing nodes is the cost


def test_overlap_hides_collectives_behind_compute_but_never_the_push():
    exposed = _model(overlap=0.0).step_s(16, compute_s=10.0)
    hidden = _model(overlap=1.0).step_s(16, compute_s=10.0)
    push = _model().ring_s(1.0, 16)
    assert exposed > hidden == push  # all of the step's collectives hidden; the push gather is not
    trainer = TrainerModel(s_per_token_gpu=1e-4, collectives=_model())
    free = TrainerModel(s_per_token_gpu=1e-4)
    assert trainer.step_s(100_000, 64) > free.step_s(100_000, 64)
    assert trainer.step_s(100_000, 1) == free.step_s(100_000, 1)


def test_the_h100_cost_models_charge_collectives():
    for name in ("h100-7b.yaml", "h100-32b.yaml"):
        trainer = TrainerModel(**yaml.safe_load((CONFIGS / name).read_text())["trainer"])
        assert trainer.collectives is not None, name
        tokens = 2_000_000
        compute = trainer.s_per_token_gpu * tokens / 512
        assert trainer.step_s(tokens, 512) - trainer.step_overhead_s - compute > 0, name
