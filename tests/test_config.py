"""Config: embedded default validates, dotted overrides apply, bad keys/values fail with clear messages."""

import pytest

from rollwise.config import ConfigError, load_config


def test_default_config_loads():
    cfg = load_config()
    assert cfg.model == "bundled:smollm2-135m-instruct"
    assert cfg.task.name == "basic_arithmetic"
    assert cfg.rollout.group_size >= 2


def test_dotted_overrides_and_aliases():
    cfg = load_config(None, ["lr=3e-5", "rollout.group_size=4", "task.params.max_terms=3", "eval.every=0"])
    assert cfg.train.lr == 3e-5
    assert cfg.rollout.group_size == 4
    assert cfg.task.params["max_terms"] == 3
    assert cfg.eval.every == 0


def test_unknown_key_names_key_and_suggests():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["train.learning_rate=1e-5"])
    msg = str(exc.value)
    assert "train.learning_rate" in msg and "'lr'" in msg
    with pytest.raises(ConfigError, match="unknown config key 'rollout.gruop_size'.*group_size"):
        load_config(None, ["rollout.gruop_size=4"])


def test_bad_values_name_field_and_allowed_values():
    with pytest.raises(ConfigError, match=r"train.advantage.*'mean_std'.*'mean'"):
        load_config(None, ["train.advantage=median"])
    with pytest.raises(ConfigError, match=r"rollout.group_size"):
        load_config(None, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.lr"])


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: {kind: reasoning_gym, name: basic_arithmetic}\ntrian: {lr: 1.0}\n")
    with pytest.raises(ConfigError, match=r"trian: unknown key.*Did you mean 'train'"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
