"""On-policy distillation (`train.teacher`, issue 41 item 4): the student samples, a teacher ENGINE scores the same
token ids (Engine.score_tokens, in process or over HTTP: POST /score), and each token's log-ratio is its reward,
trained through the per-token advantage path. Tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from rich.console import Console

from rollwise.config import ConfigError, load_config
from rollwise.control.teacher import Teacher
from rollwise.control.train_loop import train
from rollwise.engine.client import EngineClient
from rollwise.engine.scoring import MAX_SCORE_SEQUENCES
from rollwise.engine.server import build_engine, create_app
from rollwise.local_server import serve_in_thread
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.train.distill import REVERSE_KL, REWARD_MEAN, TASK_REWARD_MEAN, set_distill_rewards
from rollwise.train.token_advantages import compute_token_advantages
from rollwise.types.sample import Sample
from rollwise.types.score import ScoreSequence
from rollwise.types.sft_config import TeacherConfig
from rollwise.types.train_config import TrainConfig
from run_configs import tiny_run_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")
IDS = [3, 17, 29, 4, 88, 100, 7, 7, 61, 15, 2, 99]  # 5 prompt tokens, 7 response tokens
START = 5


@pytest.fixture(scope="module")
def teacher_server():
    """The teacher tiny:1 served by a real engine server on loopback (what train.teacher.url points at)."""
    engine, tokenizer = build_engine("tiny:1", max_num_seqs=2, max_model_len=256, seed=0)
    with serve_in_thread(create_app(engine, tokenizer, "tiny:1")) as (url, _server):
        yield url


def _forward_logprobs(model, ids: list[int], start: int, temperature: float) -> torch.Tensor:
    """Independent: the teacher model's own forward, fp32 log-softmax at the temperature, picked at each token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def local_teacher():
    """The teacher tiny:1 on a reference engine in this process, as train.teacher.model builds it."""
    teacher = Teacher.start(TeacherConfig(model="tiny:1"), tiny_tokenizer(), temperature=0.7, max_model_len=64)
    yield teacher
    teacher.close()


# Sequences of several lengths and starts (rows of the packed forward hold more than one), one of them IDS
BATCH = [ScoreSequence(token_ids=IDS, start=START), ScoreSequence(token_ids=[5, 6, 7], start=1),
         ScoreSequence(token_ids=[9, 2, 30, 41, 52, 63], start=4), ScoreSequence(token_ids=IDS[:7] + [101, 3], start=2),
         ScoreSequence(token_ids=IDS[::-1] + IDS, start=20)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_engine_scores_equal_the_models_forward(teacher_server, local_teacher, temperature):
    """A batch scored in one call (in process: one packed forward; over HTTP: one POST /score) equals each sequence
    scored alone, and the teacher model's own forward, to 1e-5."""
    model = tiny_llama(seed=1)
    expected = [_forward_logprobs(model, s.token_ids, s.start, temperature) for s in BATCH]
    alone = [local_teacher.scorer.score_tokens([s], temperature)[0] for s in BATCH]
    with EngineClient(teacher_server) as client:
        scored = {"in process": local_teacher.scorer.score_tokens(BATCH, temperature),
                  "over HTTP": client.score_tokens(BATCH, temperature)}
    for where, batch in [("alone", alone), *scored.items()]:
        assert len(batch) == len(BATCH), where
        for got, want in zip(batch, expected):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5, msg=where)


def test_scoring_teacher_reserves_no_kv_cache(local_teacher):
    """The in-process reference teacher only scores (no KV cache): it holds none, and generates nothing."""
    engine = local_teacher.scorer
    assert engine.cache is None and engine.sleeping and engine.max_num_seqs == 1


def test_batched_teacher_rewards_equal_per_sample_rewards(local_teacher):
    """Teacher.reward scores the step's samples a batch a call: the rewards equal those of each sample scored alone."""
    def samples() -> list[Sample]:
        return [Sample(sample_id=f"s{i}", group_id=f"g{i // 2}", problem_id="p", prompt_ids=s.token_ids[:s.start],
                       response_ids=s.token_ids[s.start:], behaviour_logprobs=[-1.0] * (len(s.token_ids) - s.start),
                       versions=[0] * (len(s.token_ids) - s.start), finish_reason="stop", reward=0.0)
                for i, s in enumerate(BATCH)]

    alone = [torch.tensor(local_teacher.scorer.score_tokens([s], 0.7)[0]) for s in BATCH]
    batched, expected = samples(), samples()
    metrics = local_teacher.reward(batched)
    assert metrics == pytest.approx(set_distill_rewards(expected, alone, local_teacher.cfg.coefficient), abs=1e-6)
    for got, want in zip(batched, expected):
        assert got.token_rewards == pytest.approx(want.token_rewards, abs=1e-5)


def test_score_batch_over_the_bound_is_refused_by_name(teacher_server):
    """POST /score takes at most MAX_SCORE_SEQUENCES sequences: more is a 400 naming the field and the fix."""
    body = {"sequences": [{"token_ids": [1, 2], "start": 1}] * (MAX_SCORE_SEQUENCES + 1)}
    response = httpx.post(f"{teacher_server}/score", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "sequences"
    assert f"{MAX_SCORE_SEQUENCES + 1} sequences" in error["message"] and "several requests" in error["message"]
    ok = httpx.post(f"{teacher_server}/score", json={"sequences": body["sequences"][:MAX_SCORE_SEQUENCES]}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["logprobs"]) == MAX_SCORE_SEQUENCES


@pytest.mark.parametrize("body, field", [({"sequences": [{"token_ids": IDS, "start": len(IDS)}]}, "sequences[0].start"),
                                         ({"sequences": [{"token_ids": IDS, "start": 1},
                                                         {"token_ids": [*IDS, 10**6], "start": 1}]},
                                          "sequences[1].token_ids"),
                                         ({"sequences": []}, "sequences"),
                                         ({"sequences": [{"token_ids": IDS, "start": 1}], "temperature": 0},
                                          "temperature")])
def test_bad_score_requests_name_the_field(teacher_server, body, field):
    response = httpx.post(f"{teacher_server}/score", json=body, timeout=30)
    assert response.status_code == 400 and field in response.json()["error"]["message"]


def _hand_batch() -> tuple[list[Sample], list[torch.Tensor]]:
    behaviour = [[-1.0, -2.0, -0.5], [-0.3, -0.1], [-2.0, -1.0, -1.0, -0.2]]
    teacher = [torch.tensor([-0.5, -2.5, -0.5]), torch.tensor([-1.3, -0.1]), torch.tensor([-1.0, -1.5, -0.2, -0.2])]
    samples = [Sample(sample_id=f"g{i // 2}/{i}", group_id=f"g{i // 2}", problem_id="p", prompt_ids=[1, 2],
                      response_ids=list(range(3, 3 + len(b))), behaviour_logprobs=b, versions=[0] * len(b),
                      finish_reason="stop", reward=float(i)) for i, b in enumerate(behaviour)]
    return samples, teacher


@pytest.mark.parametrize("estimator, mode", [("reinforce_pp", "replace"), ("reinforce_pp", "add"),
                                             ("reinforce_pp_baseline", "add")])
def test_per_token_rewards_and_advantages_equal_an_independent_computation(estimator, mode):
    samples, teacher = _hand_batch()
    metrics = set_distill_rewards(samples, teacher, coefficient=0.5)
    cfg = TrainConfig(advantage=estimator, teacher=TeacherConfig(model="tiny:1", mode=mode, coefficient=0.5))
    advantages = compute_token_advantages(samples, cfg).advantages
    # independent: r_t = 0.5 (log p_T - log p_S), the task reward on the last token with mode=add; undiscounted
    # returns-to-go; whitened over every token of the batch (unbiased variance). reinforce_pp_baseline: the task
    # reward minus its group's mean (g0: rewards 0 and 1; g1: one sample)
    group_mean = {"g0": 0.5, "g1": 2.0}
    returns = []
    for s, t in zip(samples, teacher):
        r = [0.5 * (tl - bl) for tl, bl in zip(t.tolist(), s.behaviour_logprobs)]
        assert s.token_rewards == pytest.approx(r, abs=1e-6)
        if mode == "add":
            r[-1] += s.reward - (group_mean[s.group_id] if estimator == "reinforce_pp_baseline" else 0.0)
        returns.append([sum(r[k:]) for k in range(len(r))])
    flat = torch.tensor([g for rs in returns for g in rs], dtype=torch.float64)
    whitened = (flat - flat.mean()) / flat.std()
    torch.testing.assert_close(torch.cat(advantages).double(), whitened, atol=1e-4, rtol=1e-4)
    kl = [float(bl - tl) for s, t in zip(samples, teacher) for tl, bl in zip(t.tolist(), s.behaviour_logprobs)]
    assert metrics[REVERSE_KL] == pytest.approx(sum(kl) / len(kl))
    assert metrics[REWARD_MEAN] == pytest.approx(-0.5 * sum(kl) / 3)
    assert metrics[TASK_REWARD_MEAN] == pytest.approx(1.0)


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    cfg = tiny_run_config(tmp_path, f"{name}.yaml", output_dir=str(tmp_path / name))
    train(load_config(cfg, ["eval.size=0", "checkpoint.every=0", "tensorboard=false", "rollout.max_tokens=8",
                            "train.advantage=reinforce_pp", *overrides]), Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_two_steps_with_a_teacher_engine(tmp_path, teacher_server):
    """Teacher == student (an in-process engine): ~0 reverse KL, ~0 distillation reward. Another teacher served over
    HTTP, mode=add: 2 steps train, and the metrics carry the distillation reward beside the task's."""
    same = _run(tmp_path, "same", "train.steps=1", "train.teacher.model=tiny:0")[0]
    assert abs(same[REVERSE_KL]) < 1e-5 and abs(same[REWARD_MEAN]) < 1e-3
    other = _run(tmp_path, "other", "train.steps=2", f"train.teacher.url={teacher_server}", "train.teacher.mode=add",
                 "train.teacher.coefficient=0.5")
    assert [r["step"] for r in other] == [1, 2]
    # another teacher: the per-token log-ratios are not 0 (one-sample estimates: either sign on near-uniform models)
    assert all(abs(r[REVERSE_KL]) > 1e-3 and abs(r[REWARD_MEAN]) > 1e-3 for r in other)
    assert all(r["reward_mean"] == pytest.approx(r[TASK_REWARD_MEAN]) for r in other)
    assert other[-1]["trained_tokens"] > 0 and other[-1]["policy_version"] == 2


def test_refused_teachers_name_the_field_and_write_nothing(tmp_path, teacher_server):
    other_vocab = tiny_tokenizer()
    other_vocab.add_tokens(["<extra>"])
    teacher_dir = tmp_path / "teacher"
    tiny_llama(seed=1, vocab_size=len(other_vocab)).save_pretrained(teacher_dir)
    other_vocab.save_pretrained(teacher_dir)
    refused = [(f"train.teacher.model={teacher_dir}", r"train\.teacher\.model=.*vocabulary"),
               (f"train.teacher.model={tmp_path / 'missing'}", r"train\.teacher\.model"),
               ("train.teacher.url=http://127.0.0.1:9", r"train\.teacher\.url"),
               (f"train.teacher.url={teacher_server} engine.max_model_len=512", r"train\.teacher\.url.*max_model_len"),
               ("train.teacher.coefficient=2", r"train\.teacher.*train\.teacher\.url")]  # no model, no url
    for override, message in refused:
        with pytest.raises(ConfigError, match=message):
            _run(tmp_path, "refused", "train.steps=1", *override.split())
        assert not (tmp_path / "refused").exists()
    # a group-relative estimator cannot take per-token rewards (as train.kl_penalty=reward)
    with pytest.raises(ConfigError, match=r"train\.teacher.*train\.advantage='mean_std'"):
        _run(tmp_path, "refused", "train.teacher.model=tiny:1", "train.advantage=mean_std")
    assert not (tmp_path / "refused").exists()
