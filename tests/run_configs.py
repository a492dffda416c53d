"""Test helper: a tiny JSONL run config (random-init `tiny:0` model, an addition task) that the CLI
and Ray tests write and change section by section. Not a test module itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def write_addition_task(path: Path, n: int = 40) -> Path:
    """`n` one-digit additions as a JSONL task ({"prompt", "answer"} per line)."""
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 10, (i * 7 // 10) % 10
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": a + b}) + "\n")
    return path


def tiny_run_config(tmp_path: Path, filename: str = "tiny.yaml", **top_level: Any) -> Path:
    """A complete config for a tiny JSONL run (no reasoning_gym task fields left over from the default),
    written to tmp_path/filename; each keyword replaces that top-level key (a whole section)."""
    cfg = {
        "model": "tiny:0",
        "seed": 0,
        "output_dir": str(tmp_path / "run"),
        "threads": 1,
        "task": {"kind": "jsonl", "path": str(write_addition_task(tmp_path / "add.jsonl"))},
        "prompt": {"system": "Reply with {answer_open}N{answer_close}.", "few_shot": []},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_tokens": 8},
        "engine": {"kind": "reference", "max_num_seqs": 8, "max_model_len": 256},
        "train": {"steps": 2, "lr": 1e-3},
        "eval": {"size": 4},
        "checkpoint": {"every": 1},
        "tensorboard": True,
        **top_level,
    }
    path = tmp_path / filename
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
