"""Exact resume through the real `train()` loop: 4 steps straight == 2 steps + resume to 4.

A random tiny model never writes the answer format, so every reward would be 0, every advantage 0
and the weights would never move: resume would be trivially "exact". The module fixture therefore
first fine-tunes the tiny model (a few seconds of supervised steps) to answer `<a>N</a>`, so groups
mix correct, wrong and broken answers, GRPO gets real gradients, and the comparison means something.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file

from rollwise.config import ConfigError, load_config
from rollwise.control.train_loop import train
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.reward.scoring import RewardConfig
from rollwise.tasks import make_task
from rollwise.tasks.prompts import build_messages, encode_prompt, PromptConfig
from rollwise.train.trainer import GRPOTrainer

ANSWER_OPEN, ANSWER_CLOSE = "<a>", "</a>"  # short tags: the tiny model's answers fit in 12 tokens
PROMPTS_PER_STEP = 2


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _write_addition_task(path: Path, n: int = 40) -> Path:
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 8, i // 8
            f.write(json.dumps({"prompt": f"{a}+{b}=?", "answer": a + b}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(task file, warmed-up model directory): a tiny Llama fine-tuned to answer in the format."""
    root = tmp_path_factory.mktemp("resume")
    task_path = _write_addition_task(root / "add.jsonl")
    task = make_task({"kind": "jsonl", "path": str(task_path)})
    tokenizer = tiny_tokenizer()
    prompt_cfg = PromptConfig(system=None, few_shot=[])
    reward_cfg = RewardConfig(answer_open=ANSWER_OPEN, answer_close=ANSWER_CLOSE)
    rows = []
    for problem in task.problems("train") + task.problems("eval"):
        prompt = encode_prompt(tokenizer, build_messages(problem, prompt_cfg, reward_cfg, with_few_shot=False))
        response = tokenizer.encode(f"{ANSWER_OPEN}{problem.answer}{ANSWER_CLOSE}") + [tokenizer.eos_token_id]
        rows.append((prompt, response))
    length = max(len(p) + len(r) for p, r in rows)
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100)
    for i, (p, r) in enumerate(rows):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)

    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(120):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model_dir = root / "warm-tiny"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return task_path, model_dir


def _write_config(path: Path, task_path: Path, model: str, output_dir: Path, steps: int, every: int) -> Path:
    cfg = {
        "model": model,
        "seed": 0,
        "output_dir": str(output_dir),
        "threads": 1,
        "task": {"kind": "jsonl", "path": str(task_path)},
        "prompt": {"system": None, "few_shot": []},
        "reward": {"answer_open": ANSWER_OPEN, "answer_close": ANSWER_CLOSE},
        "rollout": {"prompts_per_step": PROMPTS_PER_STEP, "group_size": 4, "max_tokens": 12, "temperature": 1.0},
        "engine": {"kind": "reference", "max_num_seqs": 8, "max_model_len": 128},
        "train": {"steps": steps, "lr": 1e-3},
        "eval": {"size": 2},
        "checkpoint": {"every": every, "keep_last": 5},
        "tensorboard": False,
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class TrainedProblems:
    """Records, per GRPOTrainer.train_step call, the step and the problem ids it trained (group order)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, list[str]]] = []
        original = GRPOTrainer.train_step

        def recording(trainer, samples):
            steps = {s.extra["group_index"] // PROMPTS_PER_STEP for s in samples}
            assert len(steps) == 1, steps
            problems = list(dict.fromkeys(s.problem_id for s in samples))  # one per group, in slot order
            self.calls.append((steps.pop() + 1, problems))
            return original(trainer, samples)

        monkeypatch.setattr(GRPOTrainer, "train_step", recording)


def _quiet() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, force_terminal=False), buf


def _metrics(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicate steps in metrics.jsonl: {steps}"
    return {r["step"]: r for r in records}


def _samples(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], []).append(rec["response"])
    return out


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


def test_resume_matches_straight_run(setup, tmp_path, monkeypatch):
    task_path, model_dir = setup
    recorder = TrainedProblems(monkeypatch)

    # A: 4 steps in one go.
    straight = tmp_path / "straight"
    cfg_a = _write_config(tmp_path / "a.yaml", task_path, str(model_dir), straight, steps=4, every=2)
    console, _ = _quiet()
    train(load_config(cfg_a), console)
    calls_a = list(recorder.calls)

    # B: 2 steps, then a second train() call resuming from the step-2 checkpoint up to 4 steps.
    split = tmp_path / "split"
    cfg_b = _write_config(tmp_path / "b.yaml", task_path, str(model_dir), split, steps=2, every=2)
    recorder.calls.clear()
    train(load_config(cfg_b), console)
    calls_b1 = list(recorder.calls)
    recorder.calls.clear()
    ckpt = split / "checkpoints" / "step_000002"
    console, log = _quiet()
    summary_b = train(load_config(cfg_b, ["train.steps=4", f"checkpoint.resume={ckpt}"]), console)
    calls_b2 = list(recorder.calls)
    assert "resumed" in log.getvalue() and "at step 2" in log.getvalue()

    # The same problems at every step; the resumed call trained steps 3 and 4 only; nothing twice.
    assert [s for s, _ in calls_a] == [1, 2, 3, 4]
    assert [s for s, _ in calls_b1] == [1, 2] and [s for s, _ in calls_b2] == [3, 4]
    assert calls_b1 + calls_b2 == calls_a
    trained = [pid for _, problems in calls_a for pid in problems]
    assert len(trained) == 4 * PROMPTS_PER_STEP
    assert len(set(trained)) == len(trained), "a problem was trained twice within one epoch"

    # Metrics of steps 3 and 4 agree; the run had a real learning signal (else the test proves nothing).
    ma, mb = _metrics(straight), _metrics(split)
    assert sorted(ma) == sorted(mb) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("reward_mean", "loss", "grad_norm", "entropy", "mismatch_abs_logp"):
            assert mb[step][key] == pytest.approx(ma[step][key], abs=1e-5), (step, key)
        for key in ("policy_version", "trained_tokens", "response_len_mean", "lr"):
            assert mb[step][key] == ma[step][key], (step, key)
    assert max(ma[s]["grad_norm"] for s in (3, 4)) > 1e-3, "no gradient after the resume point: vacuous test"
    assert _samples(split)[3] == _samples(straight)[3] and _samples(split)[4] == _samples(straight)[4]

    # Final weights and optimizer state agree.
    wa, wb = _weights(straight, 4), _weights(split, 4)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
    initial = load_file(model_dir / "model.safetensors")
    moved = max(float((wa[n] - initial[n]).abs().max()) for n in wa)
    assert moved > 1e-4, "training did not change the weights: vacuous comparison"
    opt_a = torch.load(straight / "checkpoints" / "step_000004" / "optimizer.pt", weights_only=False)
    opt_b = torch.load(split / "checkpoints" / "step_000004" / "optimizer.pt", weights_only=False)
    assert opt_a["scheduler"] == opt_b["scheduler"]
    for pid, state_a in opt_a["optimizer"]["state"].items():
        for key, value in state_a.items():
            torch.testing.assert_close(opt_b["optimizer"]["state"][pid][key], value, atol=1e-6, rtol=0)

    state_a = json.loads((straight / "checkpoints" / "step_000004" / "state.json").read_text())
    state_b = json.loads((split / "checkpoints" / "step_000004" / "state.json").read_text())
    for key in ("step", "policy_version", "problems_consumed", "tokenizer_fingerprint"):
        assert state_a[key] == state_b[key], key
    assert state_b["step"] == 4 and state_b["policy_version"] >= 1  # steps with no signal skip the update
    assert state_b["problems_consumed"] == 4 * PROMPTS_PER_STEP

    # The resumed run's summary still knows the accuracy before training (from the first call).
    assert summary_b["eval_before"] is not None and summary_b["eval_before"]["step"] == 0
    assert summary_b["eval_after"]["step"] == 4 and summary_b["policy_version"] == state_b["policy_version"]


def test_resume_from_older_checkpoint_does_not_duplicate_metrics(setup, tmp_path):
    """Crash after step 3 was logged but before step 4's checkpoint, then resume from step 2:
    metrics.jsonl should hold each step once (the re-run step 3 replacing the lost one)."""
    task_path, model_dir = setup
    run_dir = tmp_path / "run"
    cfg = _write_config(tmp_path / "c.yaml", task_path, str(model_dir), run_dir, steps=3, every=2)
    console, _ = _quiet()
    train(load_config(cfg), console)  # steps 1-3 logged; checkpoints at 2 and 3 (the end)
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")  # as if it crashed before saving step 3
    train(load_config(cfg, [f"checkpoint.resume={run_dir / 'checkpoints' / 'step_000002'}"]), console)
    _metrics(run_dir)  # asserts no duplicate steps


def test_resume_auto_picks_latest_checkpoint(setup, tmp_path):
    task_path, model_dir = setup
    run_dir = tmp_path / "run"  # a fixed output_dir (no {timestamp}), which 'auto' needs to find it again
    cfg = _write_config(tmp_path / "c.yaml", task_path, str(model_dir), run_dir, steps=1, every=1)
    console, _ = _quiet()
    train(load_config(cfg), console)
    console, log = _quiet()
    train(load_config(cfg, ["steps=2", "resume=auto"]), console)
    assert "resumed" in log.getvalue()
    assert sorted(_metrics(run_dir)) == [1, 2]
    last_version = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]["policy_version"]
    assert json.loads((run_dir / "checkpoints" / "step_000002" / "state.json").read_text())["policy_version"] == last_version


@pytest.mark.parametrize("target", ["missing", "empty_dir", "run_dir"])
def test_resume_from_non_checkpoint_fails_clearly(setup, tmp_path, target):
    task_path, _ = setup
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").mkdir()
    bogus = {
        "missing": tmp_path / "no" / "such" / "checkpoint",
        "empty_dir": run_dir / "checkpoints" / "step_000007",
        "run_dir": run_dir,  # a common slip: the run directory instead of one of its checkpoints
    }[target]
    if target == "empty_dir":
        bogus.mkdir()
    # tiny:0: the check must come before anything is loaded or written.
    cfg = _write_config(tmp_path / "c.yaml", task_path, "tiny:0", tmp_path / "fresh", steps=2, every=1)
    console, _ = _quiet()
    with pytest.raises(ConfigError, match="is not a checkpoint directory") as exc:
        train(load_config(cfg, [f"checkpoint.resume={bogus}"]), console)
    assert str(bogus) in str(exc.value)
    assert not (tmp_path / "fresh").exists()
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()


def test_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path):
    from rollwise.control.run_dir import resolve_run_dir

    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}"])
    assert resolve_run_dir(cfg) == (tmp_path / "run", None)  # empty or missing: fine
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="checkpoint.resume=auto"):
        resolve_run_dir(cfg)
