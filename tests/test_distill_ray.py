"""On-policy distillation under placement: ray (issue 41 item 4): the teacher of train.teacher.model runs on a Ray
actor of the run's placement group (rollwise.control.ray.teacher_actor, its own bundle), and its distillation
rewards equal those of the in-process teacher; a teacher that cannot serve the run is refused by field. Tiny random
models, a private one-node cluster."""

from __future__ import annotations

import re

import pytest

ray = pytest.importorskip("ray", reason="placement: ray needs Ray: pip install -e '.[ray]'")

from rollwise.config import load_config  # noqa: E402
from rollwise.control.ray import placement as ray_placement  # noqa: E402
from rollwise.control.teacher import Teacher  # noqa: E402
from rollwise.model.tiny import tiny_llama, tiny_tokenizer  # noqa: E402
from rollwise.types.sample import Sample  # noqa: E402
from rollwise.types.score import ScoreSequence  # noqa: E402
from ray_local import ray_cluster  # noqa: E402,F401 (the fixture)
from run_configs import tiny_run_config  # noqa: E402

PROMPTS = [[3, 17, 29, 4, 88], [9, 2, 30]]
RESPONSES = [[100, 7, 7, 61], [5, 9], [15, 2, 99, 4, 4, 31]]


def _config(tmp_path, address: str, teacher: str):
    path = tiny_run_config(tmp_path, "ray.yaml", placement="ray", tensorboard=False,
                           ray={"address": address, "engine_cpus": 0.25, "trainer_cpus": 0.25, "reward_cpus": 0.25,
                                "teacher_cpus": 0.5})
    return load_config(path, ["train.advantage=reinforce_pp", f"train.teacher.model={teacher}",
                              "rollout.temperature=0.7", "train.teacher.coefficient=0.5"])


def _samples() -> list[Sample]:
    return [Sample(sample_id=f"g{p}/{i}", group_id=f"g{p}", problem_id="p", prompt_ids=prompt, response_ids=r,
                   behaviour_logprobs=[-1.0 - 0.1 * k for k in range(len(r))], versions=[0] * len(r),
                   finish_reason="stop", reward=float(i)) for p, prompt in enumerate(PROMPTS)
            for i, r in enumerate(RESPONSES)]


def test_teacher_actor_rewards_equal_the_in_process_teacher(ray_cluster, tmp_path):
    cfg = _config(tmp_path, ray_cluster, "tiny:1")
    session = None
    try:
        on_ray = Teacher.for_run(cfg, tiny_tokenizer())
        session = ray_placement.session(cfg)
        assert session.teacher_bundles == [len(ray.util.placement_group_table(session.pg)["bundles"]) - 1]
        assert "Ray teacher actor" in on_ray.describe()
        local = Teacher.start(cfg.train.teacher, tiny_tokenizer(), temperature=0.7,
                              max_model_len=cfg.engine.max_model_len)
        remote_samples, local_samples = _samples(), _samples()
        remote_metrics = on_ray.reward(remote_samples)
        local_metrics = local.reward(local_samples)
        local.close()
        for got, want in zip(remote_samples, local_samples):
            assert got.token_rewards == pytest.approx(want.token_rewards, abs=1e-5)
            assert len(got.token_rewards) == len(got.response_ids)
        assert remote_metrics == pytest.approx(local_metrics, abs=1e-5)
        assert any(abs(r) > 1e-3 for s in remote_samples for r in s.token_rewards)  # a real signal, not all 0
        on_ray.close()
    finally:
        if session is not None:
            session.close()
    assert not ray.is_initialized()


def test_teacher_actor_of_another_vocabulary_says_so_by_field(tmp_path):
    """The actor's own class, no cluster: a teacher that cannot serve the run is said on `info` (the driver raises
    it as the ConfigError naming train.teacher.model, and lets the session go), never a Ray traceback."""
    from rollwise.control.ray.teacher_actor import TeacherActor

    other = tiny_tokenizer()
    other.add_tokens(["<extra>"])
    teacher_dir = tmp_path / "teacher"
    tiny_llama(seed=1, vocab_size=len(other)).save_pretrained(teacher_dir)
    other.save_pretrained(teacher_dir)
    actor = TeacherActor({"model": str(teacher_dir)}, tiny_tokenizer().get_vocab(), 0.7, 64, 1)
    assert re.search(r"train\.teacher\.model=.*vocabulary", actor.info()["error"])
    same = TeacherActor({"model": "tiny:1"}, tiny_tokenizer().get_vocab(), 0.7, 64, 1)
    assert "error" not in same.info() and len(same.score_tokens([ScoreSequence(token_ids=[5, 6, 7], start=1)],
                                                                0.7)[0]) == 2
