"""`rollwise sft` (issue 41 item 4): chat JSONL -> assistant-only loss -> packed rows -> a checkpoint that
`rollwise train` starts from. Tiny random models, a small generated chat file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from rollwise.config import ConfigError, load_config
from rollwise.control.train_loop import train
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.tasks.chat_jsonl import ChatExample, load_chats, tokenize_chat
from rollwise.train.sft import SftTrainer, run_sft
from rollwise.train.sft_packing import collate_rows, pack_rows, packed_logprobs
from cli_run import run_rollwise
from run_configs import tiny_run_config

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _write_chats(path: Path, n: int = 40) -> Path:
    """Conversations whose assistant replies follow a fixed rule (the reversed user word): learnable."""
    with path.open("w") as f:
        for i in range(n):
            word = "".join("abcdefgh"[(i * 7 + k * 3) % 8] for k in range(3 + i % 3))
            messages = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": word},
                        {"role": "assistant", "content": word[::-1]}]
            if i % 4 == 0:  # two-turn conversations too
                messages += [{"role": "user", "content": "again"}, {"role": "assistant", "content": word[::-1]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _chatml_expected(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Independent of the template-prefix method: ChatML laid out by hand, piece by piece; an assistant
    turn's content and its <|im_end|> (the token the model stops on) are trained, nothing else."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids: list[int] = []
    mask: list[int] = []

    def add(pieces: list[int], trained: int) -> None:
        ids.extend(pieces)
        mask.extend([trained] * len(pieces))

    for m in messages:
        assistant = int(m["role"] == "assistant")
        add([start] + tokenizer.encode(m["role"] + "\n", add_special_tokens=False), 0)
        add(tokenizer.encode(m["content"], add_special_tokens=False) + [end], assistant)
        add(tokenizer.encode("\n", add_special_tokens=False), 0)
    return ids, mask


def test_loss_mask_covers_only_assistant_tokens():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "six, 6"}]
    chat = tokenize_chat(tokenizer, ChatExample.model_validate({"messages": messages}))
    expected_ids, expected_mask = _chatml_expected(tokenizer, messages)
    assert chat.input_ids == expected_ids
    assert chat.loss_mask == expected_mask
    assert tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask) if m]) == "4<|im_end|>six, 6<|im_end|>"


def test_packed_rows_give_each_conversation_its_own_logprobs(tmp_path):
    """Several conversations in one row (block-diagonal attention, own positions) score exactly as each alone."""
    tokenizer, model = tiny_tokenizer(), tiny_llama(seed=3)
    chats = load_chats(tokenizer, _write_chats(tmp_path / "c.jsonl", 6))
    rows = pack_rows(chats, pack_tokens=4 * max(len(c.input_ids) for c in chats))
    assert len(rows) < len(chats)  # packed: fewer rows than conversations
    batch = collate_rows(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        packed, _ = packed_logprobs(model, batch)
        alone = []
        for row in rows:  # the same row order as the flattened packed tokens
            for c in row:
                ids = torch.tensor([c.input_ids])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                picked = logp.gather(-1, ids[0, 1:, None])[:, 0]
                alone.append(picked[torch.tensor(c.loss_mask[1:], dtype=torch.bool)])
    torch.testing.assert_close(packed, torch.cat(alone), atol=2e-5, rtol=1e-5)
    assert batch.n_tokens == sum(sum(c.loss_mask[1:]) for c in chats)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_sft_step_is_the_same_under_full_and_selective_checkpointing(tmp_path, compute_dtype):
    """train.gradient_checkpointing in `rollwise sft` (the RL trainer's checkpointing): the same loss and gradients
    as without it, also under bfloat16 autocast (selective's recompute replays every cast)."""
    tokenizer = tiny_tokenizer()
    chats = load_chats(tokenizer, _write_chats(tmp_path / "c.jsonl", 6))
    batch = collate_rows(pack_rows(chats, pack_tokens=128), tokenizer.pad_token_id)
    config = tiny_run_config(tmp_path)
    results = {}
    for mode in (False, True, "selective"):
        cfg = load_config(config, [f"train.compute_dtype={compute_dtype}",
                                   f"train.gradient_checkpointing={str(mode).lower()}"])
        assert cfg.train.gradient_checkpointing == mode
        trainer = SftTrainer(tiny_llama(seed=3), tokenizer, cfg, total_steps=1)
        logp, _ = trainer._logprobs(batch)
        loss = -logp.mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        results[mode] = (float(loss), grads)
    want_loss, want = results[False]
    for mode in (True, "selective"):
        loss, got = results[mode]
        assert loss == pytest.approx(want_loss, rel=1e-6), mode
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=f"{mode}: {name}")


def test_sft_lowers_held_out_loss_and_its_checkpoint_starts_train(tmp_path):
    data = _write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "sft"
    proc = run_rollwise(["sft", f"sft.data={data}", "model=tiny:0", f"output_dir={out}", "threads=1", "sft.lr=3e-3",
                      "sft.epochs=4", "sft.pack_tokens=256", "sft.rows_per_step=2", "sft.held_out_fraction=0.2",
                      "tensorboard=false"], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["held_out_conversations"] == 8
    assert summary["held_out_loss_after"] < 0.8 * summary["held_out_loss_before"], summary
    ckpt = Path(summary["checkpoint"])
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "manifest.json").exists()
    assert f"rollwise train model={ckpt}" in " ".join(proc.stdout.split())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == summary["steps"] and steps[-1]["loss"] < steps[0]["loss"]

    # `rollwise train model=<sft checkpoint>`: one step starting from the SFT weights. The tiny model answers no
    # addition right (every reward 0: no update), so the step distils from a teacher (tiny:0), whose reward varies.
    rl = tiny_run_config(tmp_path, "rl.yaml")
    result = train(load_config(rl, [f"model={ckpt}", "train.steps=1", "eval.size=0", "tensorboard=false",
                                    "train.teacher.model=tiny:0", "train.advantage=reinforce_pp"]), Console(quiet=True))
    assert result["policy_version"] == 1
    from safetensors.torch import load_file  # the run started from the SFT weights, not tiny:0's
    sft_weights = load_file(next((ckpt / "model").glob("*.safetensors")))
    initial = tiny_llama(seed=0).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(sft_weights[name], initial[name])
    rl_ckpt = Path(result["run_dir"]) / "checkpoints" / "step_000001"
    rl_weights = load_file(next((rl_ckpt / "model").glob("*.safetensors")))
    assert (rl_weights[name] - sft_weights[name]).abs().max() < (rl_weights[name] - initial[name]).abs().max()


@pytest.mark.parametrize("overrides, field", [
    ([], "sft.data"),
    (["sft.data={tmp}/missing.jsonl"], "sft.data"),
    (["sft.data={tmp}/bad.jsonl"], "sft.data"),
    (["sft.data={tmp}/ok.jsonl", "sft.micro_batch_rows=9"], "sft.micro_batch_rows"),
    (["sft.data={tmp}/ok.jsonl", "trainer.world_size=2", "trainer.device=cpu"], "trainer.world_size"),
])
def test_bad_sft_input_is_refused_naming_the_field(tmp_path, overrides, field):
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "no reply"}]}\n')
    _write_chats(tmp_path / "ok.jsonl", 4)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        cfg = load_config(None, ["model=tiny:0", f"output_dir={out}", *(o.format(tmp=tmp_path) for o in overrides)])
        run_sft(cfg, log=lambda line: None)
    assert not out.exists()  # nothing written
