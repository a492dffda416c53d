"""`rollwise sim service` (issue 39): tenants' train steps on shared, batched trainer GPUs
(rollwise.sim.lora.SharedTrainers), on the bundled H100 cost model."""

from __future__ import annotations

from dataclasses import replace

from rollwise.sim.cost import CONFIG_DIR, load_cost_file
from rollwise.sim.lora import SharedTrainers, simulate_lora
from rollwise.sim.mux import MuxJob
from rollwise.sim.service import project_service

COST, TRAINER = load_cost_file(CONFIG_DIR / "h100-7b.yaml")


def jobs(n: int, train_s=lambda tokens: 5.0 + tokens * 1e-4) -> list[MuxJob]:
    return [MuxJob(name=f"t{i}", steps=2, prompts_per_step=2, group_size=4, prompt_tokens=64, max_tokens=32,
                   train_s=train_s) for i in range(n)]


def test_one_tenant_on_one_shared_trainer_is_the_dedicated_loop():
    step_s = lambda tokens: 5.0 + tokens * 1e-4  # noqa: E731
    own = simulate_lora(jobs(1, step_s), 1, COST)
    shared = simulate_lora(jobs(1, step_s), 1, COST, trainers=SharedTrainers(gpus=1, step_s=step_s))
    assert shared["makespan_s"] == own["makespan_s"]


def test_batched_tenants_pay_the_step_overhead_once_per_batch():
    """Three one-step tenants finish generating within a second: the first trains alone (5 s) while the other
    two queue; batched, those two then train in one 5 s step, one at a time they take 10 s."""
    overhead_only = lambda tokens: 5.0  # noqa: E731
    tenants = [replace(j, steps=1) for j in jobs(3, overhead_only)]
    batched = simulate_lora(tenants, 1, COST, trainers=SharedTrainers(gpus=1, step_s=overhead_only))
    one_at_a_time = simulate_lora(tenants, 1, COST,
                                  trainers=SharedTrainers(gpus=1, step_s=overhead_only, max_batch_tokens=1))
    assert abs(one_at_a_time["makespan_s"] - batched["makespan_s"] - 5.0) < 0.5
    assert 0.0 < batched["trainer_utilisation"] <= 1.0


def test_projection_saves_gpu_hours_and_more_gpus_cut_the_slowdown():
    rows = project_service(tenants=8, gpu_counts=(4, 8), steps=2)
    assert [r["gpus"] for r in rows] == [4, 8]
    assert all(r["engine_gpus"] + r["trainer_gpus"] == r["gpus"] for r in rows)
    assert all(r["gpu_hours_saved"] > 0 for r in rows)  # 8 tenants alone hold 16 GPUs
    assert rows[1]["median_slowdown"] < rows[0]["median_slowdown"]
