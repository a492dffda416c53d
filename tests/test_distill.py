"""On-policy distillation (`train.teacher`, issue 41 item 4): the teacher scores the student's sampled tokens,
the reverse KL on them is the reward. Tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from rollwise.config import ConfigError, load_config
from rollwise.types.train_config import TrainConfig
from rollwise.control.train_loop import train
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.train.advantages import assign_advantages
from rollwise.train.distill import REVERSE_KL, Teacher
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample
from rollwise.types.sft_config import TeacherConfig
from run_configs import tiny_run_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    cfg = tiny_run_config(tmp_path, f"{name}.yaml", output_dir=str(tmp_path / name))
    train(load_config(cfg, ["train.steps=1", "eval.size=0", "checkpoint.every=0", "tensorboard=false",
                            "rollout.max_tokens=12", *overrides]), Console(quiet=True))
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_reverse_kl_in_the_loop(tmp_path):
    """Teacher == student: the reverse KL is 0 to float round-off (engine vs in-process forward); another teacher:
    > 0, and mode=add adds the distillation reward to the task's."""
    same = _run(tmp_path, "same", "train.teacher.model=tiny:0")[0]
    assert abs(same[REVERSE_KL]) < 1e-5 and abs(same["distill/reward_mean"]) < 1e-3
    other = _run(tmp_path, "other", "train.teacher.model=tiny:1", "train.teacher.mode=add",
                 "train.teacher.coefficient=0.5")[0]
    assert other[REVERSE_KL] > 1e-3
    assert other["reward_mean"] == pytest.approx(other["distill/reward_mean"] + other["distill/task_reward_mean"],
                                                 abs=1e-5)
    assert other["trained_tokens"] > 0 and other["policy_version"] == 1


def test_refused_teacher_names_the_field_and_writes_nothing(tmp_path):
    other_vocab = tiny_tokenizer()
    other_vocab.add_tokens(["<extra>"])
    teacher_dir = tmp_path / "teacher"
    tiny_llama(seed=1, vocab_size=len(other_vocab)).save_pretrained(teacher_dir)
    other_vocab.save_pretrained(teacher_dir)
    for spec in (str(teacher_dir), str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match=r"train\.teacher\.model"):
            _run(tmp_path, "refused", f"train.teacher.model={spec}")
        assert not (tmp_path / "refused").exists()


def _sample(student, prompt: list[int], n: int, length: int, seed: int) -> list[Sample]:
    """n responses sampled from the student by plain torch (temperature 1), with their log-probs."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * n)
    logps = []
    with torch.no_grad():
        for _ in range(length):
            logp = torch.log_softmax(student(input_ids=ids).logits[:, -1].float(), -1)
            token = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(-1, token))
            ids = torch.cat([ids, token], 1)
    logps_t = torch.cat(logps, 1)
    return [Sample(sample_id=f"g/{i}", group_id="g", problem_id="p", prompt_ids=prompt,
                   response_ids=ids[i, len(prompt):].tolist(), behaviour_logprobs=logps_t[i].tolist(),
                   versions=[0] * length, finish_reason="length") for i in range(n)]


def _token_reverse_kl(student, teacher, samples: list[Sample]) -> float:
    """Exact KL(S || T) over the whole vocabulary, averaged over every sampled position's context."""
    ids = torch.tensor([[*s.prompt_ids, *s.response_ids] for s in samples])
    p = len(samples[0].prompt_ids)
    with torch.no_grad():
        s_logp = torch.log_softmax(student(input_ids=ids).logits[:, p - 1:-1].float(), -1)
        t_logp = torch.log_softmax(teacher(input_ids=ids).logits[:, p - 1:-1].float(), -1)
    return float((s_logp.exp() * (s_logp - t_logp)).sum(-1).mean())


def test_teacher_reward_and_its_gradient_move_the_student_toward_the_teacher():
    torch.manual_seed(0)
    student = tiny_llama(seed=0)
    teacher_model = tiny_llama(seed=1, tie_word_embeddings=False)
    with torch.no_grad():
        teacher_model.lm_head.weight.mul_(6.0)  # a sharp teacher, far from the near-uniform random student
    tokenizer = tiny_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    samples = _sample(student, prompt, n=48, length=10, seed=0)
    teacher = Teacher(teacher_model, TeacherConfig(model="tiny:1", coefficient=2.0), temperature=1.0,
                      pad_token_id=tokenizer.pad_token_id)

    # the teacher's log-probs and the reward against an independent forward of the teacher
    ids = torch.tensor([[*s.prompt_ids, *s.response_ids] for s in samples])
    with torch.no_grad():
        t_all = torch.log_softmax(teacher_model(input_ids=ids).logits[:, len(prompt) - 1:-1].float(), -1)
    t_logp = t_all.gather(-1, ids[:, len(prompt):, None])[..., 0]
    metrics = teacher.reward(samples)
    b_logp = torch.tensor([list(s.behaviour_logprobs) for s in samples])
    expected = 2.0 * (t_logp - b_logp).sum(1)
    torch.testing.assert_close(torch.tensor([s.reward for s in samples]), expected, atol=1e-4, rtol=1e-5)
    assert metrics[REVERSE_KL] == pytest.approx(float((b_logp - t_logp).mean()), abs=1e-5)
    assert all(s.extra["task_reward"] == 0.0 for s in samples)

    # one policy-gradient step on that reward lowers the exact reverse KL to the teacher
    assign_advantages(samples, "mean_std")
    before = _token_reverse_kl(student, teacher_model, samples)
    trainer = GRPOTrainer(student, TrainConfig(lr=3e-3, steps=1), pad_token_id=tokenizer.pad_token_id)
    trainer.train_step(samples)
    student.eval()
    after = _token_reverse_kl(student, teacher_model, samples)
    assert after < before - 0.01, (before, after)
