"""Agent episodes are scored as the single-turn path scores its groups (issue 40, item 5): a group goes to the reward
pool as soon as its episodes are done and is scored while the other episodes run (rollwise.rollout.group_scoring),
shown by the times the controller records, not by a timing bound."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(180)]

SLOW_REWARD = '''
import time

def slow_reward(problem, response, finish_reason):
    time.sleep(0.5)  # a verifier that waits on something (a model, a test run)
    return 1.0 if problem.answer in response else 0.0
'''


def test_agent_groups_are_scored_while_other_episodes_run(tmp_path):
    from rich.console import Console

    from rollwise.config import load_config
    from rollwise.control.train_loop import train

    (tmp_path / "slow_reward.py").write_text(SLOW_REWARD)
    # agent.concurrency=2 = group_size: the groups' episodes run one group after another, so while group g is scored
    # group g+1's episodes are running, and the scoring of every group but the last is hidden behind them.
    cfg = load_config(None, [
        "model=tiny:0", "agent={tools: [calculator], max_turns: 2, max_tokens_per_turn: 12, max_tokens: 32, "
        "concurrency: 2}", "steps=1", "prompts_per_step=3", "group_size=2", "eval.size=0", "eval.every=0",
        f"output_dir={tmp_path}/run", "engine.kind=reference", "engine.max_model_len=2048", "tensorboard=false",
        "checkpoint.every=0", "reward.executor=pool", "reward.workers=2",
        f"reward.function={tmp_path / 'slow_reward.py'}:slow_reward",
    ])
    summary = train(cfg, Console(quiet=True))
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["steps"] == 1 and record["batch_samples"] >= 6 and record["reward_errors"] == 0
    # every episode was scored by the slow function (its 0.5 s shows in each group's scoring time)
    assert record["reward_scoring_s"] >= 3 * 0.5
    # other episodes finished while a group was being scored ...
    assert record["reward_overlapped_completions"] >= 1
    # ... so the scoring the step waited for after its last episode is less than the scoring done
    assert record["reward_after_generation_s"] < record["reward_scoring_s"]
    assert summary["samples"]["trained"] + summary["samples"]["dropped"] == 6, summary["samples"]
