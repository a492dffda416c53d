"""tinker-cookbook's own RL recipe, unmodified, against `rollwise serve tinker` (issue 39 item 4).

`python -m tinker_cookbook.recipes.math_rl.train env=arithmetic` runs as a user runs it (its own process, its own
SDK client, a local model directory as model name, renderer role_colon, loss importance_sampling), for two steps
on a tiny random model: what is asserted is that every call the recipe makes is answered as the SDK expects
(the run finishes, logs both steps, and its final named save_state / save_weights_for_sampler exist on the
server), not that a random model learns (docs/benchmarks/service.md measures learning on SmolLM2).

The cookbook's one outbound request (a pricing file) is kept on the machine: HTTPS_PROXY points at a closed
loopback port (/work/shared/reference/tinker-verifiers.md §8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollwise.local_server import free_port
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from tests.tinker_server import tinker_server


KEY = "tml-cookbook-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    model_dir = root / "tiny-model"
    tiny_llama(seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    with tinker_server(root, [KEY], str(model_dir)) as srv:
        yield srv.url, model_dir, root


def test_math_rl_recipe_runs_unchanged(server, tmp_path):
    url, model_dir, _ = server
    closed_port = free_port()  # nothing listens: the pricing fetch fails fast and is only logged
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "HTTPS_PROXY": f"http://127.0.0.1:{closed_port}", "HTTP_PROXY": f"http://127.0.0.1:{closed_port}",
           "NO_PROXY": "127.0.0.1,localhost", "WANDB_MODE": "disabled"}
    log_path = tmp_path / "cookbook-run"
    args = [f"base_url={url}", "env=arithmetic", f"model_name={model_dir}", "renderer_name=role_colon",
            "loss_fn=importance_sampling", "groups_per_batch=2", "group_size=2", "max_tokens=4", "lora_rank=4",
            "eval_every=0", "save_every=0", "max_steps=2", f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete"]
    done = subprocess.run([sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "step" in s][:2] == [0, 1]
    # The run ends with save_state("final") and save_weights_for_sampler("final"): both answered with paths
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    final = checkpoints[-1]
    assert final["name"] == "final"
    assert final["state_path"].startswith("tinker://") and "/weights/final" in final["state_path"]
    assert final["sampler_path"].startswith("tinker://") and "/sampler_weights/final" in final["sampler_path"]
