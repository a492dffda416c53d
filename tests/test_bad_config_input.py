"""Bad config and `rollwise train` input (issue 43): each refused with one line naming the field or the
file, an exit code != 0, no traceback, and nothing written (no run directory, the workspace unchanged).

- values (the Python API, load_config): true/false for a number, NaN and Infinity in any float field of any
  section, Adam betas outside [0, 1), requests that cannot fit the engine (max_tokens vs max_model_len,
  group_size vs max_num_seqs), LoRA with FSDP2 bf16 mixed precision or CPU offload;
- `--config` files that are not UTF-8 YAML: binary, a directory, UTF-16 (`rollwise config`, the CLI's main);
- `rollwise train` inputs only a run can check: the model (missing, corrupt, truncated, no tokenizer, unknown
  architecture), the task file (missing, a directory, empty, not JSON, binary, a key missing), the run
  directory (under a file, unwritable, a read-only or full disk), placement=ray without Ray, CUDA without a
  GPU, threads beyond the cores, an unreachable pool, an unknown tool-call parser. Through the CLI's main in this process (cheap:
  each fails before any engine starts), and threads=100000 as a real subprocess, which used to segfault.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rollwise.cli import main
from rollwise.config import ConfigError, load_config
from rollwise.control.preflight import usable_cores
from rollwise.model.loading import load_model
from run_configs import tiny_run_config, write_addition_task

# ------------------------------------------------------------------ config values (Python API)

# (overrides, what the message must name)
BAD_VALUES = {
    "bool_for_float": (["train.lr=true"], "train.lr"),
    "bool_for_int": (["seed=true"], "seed"),
    "bool_in_betas": (["train.adam_betas=[true, 0.9]"], "train.adam_betas"),
    "nan_beta": (["train.adam_betas=[.nan, 0.9]"], "train.adam_betas.0"),
    "beta_one": (["train.adam_betas=[0.9, 1.0]"], "train.adam_betas.1"),
    "beta_negative": (["train.adam_betas=[-0.1, 0.9]"], "train.adam_betas.0"),
    "inf_lr": (["train.lr=.inf"], "train.lr"),
    "inf_lr_text": (["train.lr=inf"], "train.lr"),
    "inf_temperature": (["rollout.temperature=.inf"], "rollout.temperature"),
    "overflow_weight_decay": (["train.weight_decay=1e999"], "train.weight_decay"),
    "inf_oversubscription": (["rollout.oversubscription=.inf"], "rollout.oversubscription"),
    "inf_priority": (["pool.priority=.inf"], "pool.priority"),
    "nan_reward": (["reward.correct=.nan"], "reward.correct"),
    "nan_task_fraction": (["task.eval_fraction=.nan"], "task.eval_fraction"),
    "nan_few_shot": (["prompt.few_shot_start=.nan"], "prompt.few_shot_start"),
    "max_tokens_over_context": (["rollout.max_tokens=1000000", "engine.max_model_len=512"], "rollout.max_tokens=1000000"),
    "eval_tokens_fill_context": (["eval.max_tokens=256"], "engine.max_model_len=256"),
    "group_over_engine": (["rollout.group_size=16", "engine.max_num_seqs=8"], "engine.max_num_seqs=8"),
    "agent_budget_fills_context": (["agent.max_tokens=256"], "agent.max_tokens=256"),
    "lora_with_bf16": (["train.lora.rank=4", "trainer.mixed_precision=bf16"], "trainer.mixed_precision=bf16"),
    "lora_with_offload": (["train.lora.rank=4", "trainer.cpu_offload=true"], "trainer.cpu_offload=true"),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model saved to disk (the corrupt variants start from it) and a tiny JSONL run config."""
    root = tmp_path_factory.mktemp("bad-input")
    model, tokenizer = load_model("tiny:0")
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    tiny_run_config(root)
    return root


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_value_is_one_line_naming_the_field(workspace: Path, case: str):
    overrides, names = BAD_VALUES[case]
    with pytest.raises(ConfigError) as refused:
        load_config(workspace / "tiny.yaml", overrides)
    message = str(refused.value)
    assert "\n" not in message and names in message, message


def test_numbers_written_as_yaml_reads_them_still_load(workspace: Path):
    # PyYAML reads 1e-5 (no dot) as text: lax parsing stays, and booleans stay where a field takes them.
    cfg = load_config(workspace / "tiny.yaml", ["train.lr=1e-5", "tensorboard=false", "task.seed=3",
                                                 "train.adam_betas=[0, 0.5]", "rollout.max_tokens=255"])
    assert cfg.train.lr == 1e-5 and cfg.tensorboard is False and cfg.train.adam_betas == (0.0, 0.5)
    rg = load_config(None, ["task.params.allow_negation=true"])  # task.params takes anything
    assert rg.task.params["allow_negation"] is True


# ------------------------------------------------------------------ --config files (`rollwise config`)

CONFIG_FILES: dict[str, Callable[[Path], Path]] = {
    "binary": lambda d: _write(d / "binary.yaml", bytes(range(256)) * 4),
    "directory": lambda d: d,
    "utf16_bom": lambda d: _write(d / "utf16.yaml", "model: tiny:0\n".encode("utf-16")),
    "utf16_no_bom": lambda d: _write(d / "utf16le.yaml", "model: tiny:0\n".encode("utf-16-le")),
    "nul_bytes": lambda d: _write(d / "nul.yaml", b"model: tiny\x00:0\n"),
    "broken_yaml": lambda d: _write(d / "broken.yaml", b"model: [tiny\ntask: {kind: jsonl\n"),
    "not_a_mapping": lambda d: _write(d / "list.yaml", b"- model\n- task\n"),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refusal(capsys: pytest.CaptureFixture[str], rc: int) -> str:
    """The CLI's one error line, after checking the exit code, that it is alone and there is no traceback."""
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc != 0, text
    assert "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith(("config error:", "error:"))]
    assert len(errors) == 1, text
    return errors[0]


@pytest.mark.parametrize("case", list(CONFIG_FILES))
def test_config_file_that_is_not_yaml_text(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str):
    path = CONFIG_FILES[case](tmp_path)
    before = _tree(tmp_path)
    line = _refusal(capsys, main(["config", "--config", str(path)]))
    assert line.startswith("config error:") and str(path) in line, line
    assert _tree(tmp_path) == before


# ------------------------------------------------------------------ `rollwise train` inputs

def _model_variant(workspace: Path, name: str, change: Callable[[Path], object]) -> str:
    folder = workspace / name
    if not folder.exists():
        shutil.copytree(workspace / "model", folder)
        change(folder)
    return str(folder)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def _drop_tokenizer(folder: Path) -> None:
    for path in folder.iterdir():
        if "token" in path.name or path.name in ("vocab.json", "merges.txt"):
            path.unlink()


def _unknown_architecture(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))


QUESTION_ONLY = json.dumps({"question": "1 + 1?", "answer": 2}).encode()  # no "prompt" key


def _task_file(tmp: Path, name: str, data: bytes) -> str:
    return str(_write(tmp / name, data))


# case -> (overrides from (workspace, this test's tmp_path), what the one line must name)
TRAIN_INPUTS: dict[str, tuple[Callable[[Path, Path], list[str]], str]] = {
    "model_missing": (lambda w, t: [f"model={t}/no-such-model"], "no-such-model"),
    "model_bundled_unknown": (lambda w, t: ["model=bundled:no-such"], "no-such"),
    "model_tiny_not_a_seed": (lambda w, t: ["model=tiny:abc"], "tiny:abc"),
    "model_empty_dir": (lambda w, t: [f"model={_model_variant(w, 'empty', lambda d: [p.unlink() for p in d.iterdir()])}"],
                        "empty"),
    "model_a_file": (lambda w, t: [f"model={w}/tiny.yaml"], "tiny.yaml"),
    "model_config_not_json": (lambda w, t: [f"model={_model_variant(w, 'garbage', lambda d: (d / 'config.json').write_text('{no'))}"],
                              "garbage"),
    "model_no_weights": (lambda w, t: [f"model={_model_variant(w, 'noweights', lambda d: (d / 'model.safetensors').unlink())}"],
                         "noweights"),
    "model_truncated_weights": (lambda w, t: [f"model={_model_variant(w, 'truncated', lambda d: _truncate(d / 'model.safetensors'))}"],
                                "truncated"),
    "model_no_tokenizer": (lambda w, t: [f"model={_model_variant(w, 'notokenizer', _drop_tokenizer)}"], "notokenizer"),
    "model_unknown_architecture": (lambda w, t: [f"model={_model_variant(w, 'unknownarch', _unknown_architecture)}"],
                                   "unknownarch"),
    "task_missing": (lambda w, t: [f"task.path={t}/no-such.jsonl"], "no-such.jsonl"),
    "task_a_directory": (lambda w, t: [f"task.path={t}"], "is a directory"),
    "task_empty": (lambda w, t: [f"task.path={_task_file(t, 'empty.jsonl', b'')}"], "empty.jsonl"),
    "task_not_json": (lambda w, t: [f"task.path={_task_file(t, 'bad.jsonl', b'{not json')}"], "bad.jsonl:1"),
    "task_binary": (lambda w, t: [f"task.path={_task_file(t, 'bin.jsonl', bytes(range(128, 256)))}"], "bin.jsonl:1"),
    "task_key_missing": (lambda w, t: [f"task.path={_task_file(t, 'keys.jsonl', QUESTION_ONLY)}"], "'prompt'"),
    "task_eval_file_missing": (lambda w, t: [f"task.eval_path={t}/no-eval.jsonl"], "no-eval.jsonl"),
    "output_under_a_file": (lambda w, t: [f"output_dir={w}/tiny.yaml/run"], "output_dir"),
    "output_unwritable": (lambda w, t: ["output_dir=/proc/rollwise-run"], "output_dir"),
    "threads_beyond_cores": (lambda w, t: [f"threads={usable_cores() + 1}"], "threads="),
    "pool_unreachable": (lambda w, t: ["pool.url=http://127.0.0.1:9"], "pool.url"),
    "agent_parser_unknown": (lambda w, t: ["agent.parser=no-such", "engine.max_model_len=1024"], "agent.parser=no-such"),
}


def _train_refused(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str]) -> str:
    """`rollwise train` on the tiny config with `overrides`: its one error line; nothing was written."""
    config = tiny_run_config(tmp_path, threads=0, train={"steps": 1, "lr": 1e-3})
    before = _tree(tmp_path)
    line = _refusal(capsys, main(["train", "--config", str(config), *overrides]))
    assert _tree(tmp_path) == before and not (tmp_path / "run").exists()
    return line


@pytest.mark.parametrize("case", list(TRAIN_INPUTS))
def test_train_input_refused_before_anything_is_written(workspace: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str], case: str):
    overrides, names = TRAIN_INPUTS[case]
    args = overrides(workspace, tmp_path)
    line = _train_refused(workspace, tmp_path, capsys, args)
    assert names in line, line


def test_placement_ray_without_ray(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as where it is not installed
    line = _train_refused(workspace, tmp_path, capsys, ["placement=ray"])
    assert "placement=ray" in line and "Ray" in line, line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize(("overrides", "names"), [
    (["trainer.device=cuda"], "trainer.device=cuda"),
    (["trainer.device=cuda", "trainer.mixed_precision=bf16"], "trainer.device=cuda"),
    (["trainer.cpu_offload=true"], "trainer.cpu_offload=true"),
])
def test_cuda_without_a_gpu(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str],
                            names: str):
    line = _train_refused(workspace, tmp_path, capsys, overrides)
    assert names in line, line


@pytest.fixture(scope="module")
def small_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A full filesystem and a read-only one: 1 MiB tmpfs mounts (where this process may mount), the first
    filled up with one file."""
    root = tmp_path_factory.mktemp("mounts")
    mounts = {"full": root / "full", "read_only": root / "read_only"}
    done = []
    for name, options in (("full", "size=1m"), ("read_only", "size=1m,ro")):
        mounts[name].mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mounts[name])],
                                               capture_output=True).returncode != 0:
            break
        done.append(mounts[name])
    try:
        if len(done) < 2:
            pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN")
        with (mounts["full"] / "filler").open("wb") as filler:
            with contextlib.suppress(OSError):  # until the disk is full
                while True:
                    filler.write(bytes(64 << 10))
                    filler.flush()
        yield mounts
    finally:
        for path in done:
            subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.parametrize("disk", ["full", "read_only"])
def test_full_or_read_only_disk(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                small_mounts: dict[str, Path], disk: str):
    before = _tree(small_mounts[disk])
    line = _train_refused(workspace, tmp_path, capsys, [f"output_dir={small_mounts[disk]}/run"])
    assert "output_dir" in line and str(small_mounts[disk]) in line, line
    assert _tree(small_mounts[disk]) == before


def test_threads_beyond_the_machine_in_a_real_process(workspace: Path, tmp_path: Path):
    # torch.set_num_threads(100000) crashed the process (SIGSEGV): refused before torch is told.
    config = tiny_run_config(tmp_path)
    before = _tree(tmp_path)
    script = Path(sys.executable).parent / "rollwise"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollwise.cli"]
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "80"}  # narrow: the error still comes as one line
    proc = subprocess.run([*cmd, "train", "--config", str(config), "threads=100000"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "threads=100000" in errors[0], text
    assert _tree(tmp_path) == before


def test_group_larger_than_the_pools_engines(workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # pool.url: the pool's engines have their own max_num_seqs; the attach checks the run's requests against it.
    from rollwise.local_server import serve_in_thread
    from rollwise.pool.scheduler import Policy
    from rollwise.pool.engine_pool import EnginePool
    from rollwise.pool.app import create_app

    pool = EnginePool(1, max_num_seqs=2, max_model_len=96, policy=Policy(min_slice_s=0.05))
    with serve_in_thread(create_app(pool)) as (url, _):
        line = _train_refused(workspace, tmp_path, capsys, [f"pool.url={url}", "rollout.group_size=4"])
        state = pool.state()
    assert "rollout.group_size=4" in line and "the pool's max_num_seqs" in line, line
    assert not state["jobs"], state  # detached again
