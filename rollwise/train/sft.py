"""`rollwise sft`: supervised fine-tuning on chat JSONL, handing its checkpoint to `rollwise train`.

    chat JSONL -> chat template + assistant-only loss mask (rollwise.tasks.chat_jsonl)
               -> rows packed to sft.pack_tokens (rollwise.train.sft_packing) -> AdamW on the token-mean NLL
               -> checkpoints in `rollwise train`'s format (rollwise.train.checkpoint)

A checkpoint's `model/` is a Hugging Face directory (weights and tokenizer), so an RL run starts from it
with `rollwise train model=RUN/checkpoints/step_NNNNNN` (or that folder's model/). The held-out loss (mean
negative log-likelihood per assistant token) is measured before and after training (and every
sft.eval_every steps) and written to evals.jsonl; each step's record goes to metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor, nn

import rollwise.train.checkpoint as checkpoint
from rollwise.config import ConfigError, RunConfig, dump_config
from rollwise.types.train_config import TrainConfig
from rollwise.model.loading import load_model, tokenizer_fingerprint
from rollwise.model.precision import resolve_dtype
from rollwise.observe.metrics import MetricsLogger
from rollwise.observe.run_logs import EVALS_LOG, METRICS_LOG
from rollwise.tasks.chat_jsonl import TokenizedChat, load_chats, split_chats
from rollwise.train.activation_checkpointing import autocast_cache_enabled, enable_activation_checkpointing
from rollwise.train.logprobs import LogprobOptions
from rollwise.train.sft_packing import PackedRows, collate_rows, cut, pack_rows, packed_logprobs
from rollwise.train.trainer import lr_factor


class SftTrainer:
    """The model, AdamW and its schedule: a rollwise.train.checkpoint.CheckpointedTrainer (so its checkpoints
    are `rollwise train`'s), with weights() as the RL trainer hands them to a weight transport."""

    def __init__(self, model: nn.Module, tokenizer: Any, cfg: RunConfig, total_steps: int, device: str = "cpu"):
        self.model = model.to(device)
        self.tokenizer = tokenizer
        self.train_cfg = cfg.train
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.version = 0  # optimizer updates applied
        self.compute_dtype = resolve_dtype(cfg.train.compute_dtype, device)
        self.device = device
        model.config.use_cache = False
        enable_activation_checkpointing(model, cfg.train.gradient_checkpointing)  # as the RL trainer's
        schedule = TrainConfig(steps=total_steps, lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps,
                               lr_schedule=cfg.sft.lr_schedule, min_lr_ratio=cfg.sft.min_lr_ratio)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.sft.lr,
                                           betas=cfg.train.adam_betas, weight_decay=cfg.train.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, partial(lr_factor, schedule))

    def _logprobs(self, batch: PackedRows) -> tuple[Tensor, Tensor]:
        autocast = self.compute_dtype != next(self.model.parameters()).dtype
        with torch.autocast(self.device, dtype=self.compute_dtype, enabled=autocast,
                            cache_enabled=autocast_cache_enabled(self.train_cfg.gradient_checkpointing)):
            # SFT's targets are data, not samples: the untempered distribution.
            logp, entropy = packed_logprobs(self.model, batch, LogprobOptions.of(self.train_cfg, temperature=1.0))
        return logp.float(), entropy.float()

    def train_step(self, micro_batches: list[PackedRows]) -> dict[str, float]:
        """One optimizer update: the mean NLL over every trained token of the micro-batches."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = sum(mb.n_tokens for mb in micro_batches)
        nll_sum = 0.0
        for mb in micro_batches:
            logp, _ = self._logprobs(mb)
            loss = -logp.sum() / max(n_tokens, 1)
            loss.backward()
            nll_sum += float(-logp.detach().sum())
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_cfg.grad_clip))
        skipped = not math.isfinite(norm)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": nll_sum / max(n_tokens, 1), "grad_norm": norm, "trained_tokens": float(n_tokens),
                "update_skipped_nonfinite_grad": float(skipped), "lr": self.scheduler.get_last_lr()[0]}

    @torch.no_grad()
    def held_out_loss(self, micro_batches: list[PackedRows]) -> float:
        """Mean negative log-likelihood per held-out assistant token."""
        self.model.eval()
        total, n = 0.0, 0
        for mb in micro_batches:
            logp, _ = self._logprobs(mb)
            total += float(-logp.sum())
            n += mb.n_tokens
        self.model.train()
        return total / max(n, 1)

    def weights(self) -> dict[str, Tensor]:
        return {name: t.detach() for name, t in self.model.state_dict().items()}

    def save_checkpoint(self, run_dir: Path, step: int, extra: dict[str, Any], keep_last: int) -> Path:
        return checkpoint.save_checkpoint(run_dir, self, self.tokenizer, step, extra, keep_last)

    def load_checkpoint(self, ckpt: Path) -> dict[str, Any]:
        return checkpoint.load_checkpoint(ckpt, self)


def sft_run_dir(cfg: RunConfig) -> Path:
    """output_dir with {task_name} sft-<data file stem>."""
    return cfg.output_path(f"sft-{Path(cfg.sft.data or 'data').stem}")


def _check(cfg: RunConfig) -> None:
    """Refusals before anything loads or is written, each naming its field."""
    if cfg.sft.data is None:
        raise ConfigError("sft.data is not set: pass the chat JSONL to train on, e.g. `rollwise sft "
                          "sft.data=examples/sft_chat.jsonl` (one {\"messages\": [...]} per line)")
    if cfg.train.lora is not None:
        raise ConfigError("train.lora: rollwise sft trains every parameter for now (its checkpoint is the "
                          "model `rollwise train` starts from): unset train.lora")
    if cfg.trainer.world_size > 1:
        raise ConfigError(f"trainer.world_size={cfg.trainer.world_size}: rollwise sft trains in one process for now: "
                          "set trainer.world_size=1")
    if cfg.sft.micro_batch_rows > cfg.sft.rows_per_step:
        raise ConfigError(f"sft.micro_batch_rows={cfg.sft.micro_batch_rows} exceeds sft.rows_per_step="
                          f"{cfg.sft.rows_per_step}: set it to at most {cfg.sft.rows_per_step}")


def _load_data(cfg: RunConfig, tokenizer: Any) -> tuple[list[TokenizedChat], list[TokenizedChat], int]:
    try:
        chats = load_chats(tokenizer, cfg.sft.data or "", "sft.data")
        if cfg.sft.eval_data is not None:
            train, held = chats, load_chats(tokenizer, cfg.sft.eval_data, "sft.eval_data")
        else:
            train, held = split_chats(chats, cfg.sft.held_out_fraction, cfg.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    train, n_cut = cut(train, cfg.sft.pack_tokens)
    held, n_cut_held = cut(held, cfg.sft.pack_tokens)
    if not train:
        raise ConfigError(f"sft.data={cfg.sft.data!r}: no conversation left to train on (every one held out, or "
                          "with no assistant token within sft.pack_tokens): add conversations or lower "
                          "sft.held_out_fraction")
    return train, held, n_cut + n_cut_held


def _micro_batches(rows: list[list[TokenizedChat]], size: int, pad_id: int) -> list[PackedRows]:
    return [collate_rows(rows[i:i + size], pad_id) for i in range(0, len(rows), size)]


def _row_stream(rows: list[list[TokenizedChat]], seed: int) -> Iterator[list[TokenizedChat]]:
    """The packed rows, epoch after epoch, each epoch in a new seeded order."""
    rng = random.Random(seed)
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        yield from (rows[i] for i in order)


def run_sft(cfg: RunConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train as configured; returns the summary also written to summary.json."""
    t0 = time.monotonic()
    _check(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    run_dir = sft_run_dir(cfg)
    if (run_dir / METRICS_LOG).exists():
        raise ConfigError(f"run directory {run_dir} already holds a run: choose another output_dir (the default "
                          "has a {timestamp})")
    try:
        model, tokenizer = load_model(cfg.model)
    except ValueError as exc:
        raise ConfigError(f"model={cfg.model!r}: {exc}") from None
    train_chats, held_chats, n_cut = _load_data(cfg, tokenizer)
    rows = pack_rows(train_chats, cfg.sft.pack_tokens)
    steps = cfg.sft.steps or cfg.sft.epochs * math.ceil(len(rows) / cfg.sft.rows_per_step)
    device = "cuda" if torch.cuda.is_available() and cfg.trainer.device != "cpu" else "cpu"
    trainer = SftTrainer(model, tokenizer, cfg, steps, device)
    held_batches = _micro_batches(pack_rows(held_chats, cfg.sft.pack_tokens), cfg.sft.micro_batch_rows, trainer.pad_id)
    fingerprint = tokenizer_fingerprint(tokenizer)

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    log(f"rollwise sft  model={cfg.model}  data={cfg.sft.data}: {len(train_chats)} conversations in {len(rows)} rows "
        f"of {cfg.sft.pack_tokens} tokens ({n_cut} cut to fit), {len(held_chats)} held out  steps={steps}  "
        f"lr={cfg.sft.lr}\n  run dir: {run_dir}")
    logger = MetricsLogger(run_dir, tensorboard=cfg.tensorboard, tracking=cfg.logging, config=dump_config(cfg))
    evals: list[dict[str, Any]] = []

    def evaluate(step: int, label: str) -> None:
        if not held_batches:
            return
        record = {"step": step, "label": label, "held_out_loss": trainer.held_out_loss(held_batches),
                  "held_out_tokens": sum(b.n_tokens for b in held_batches), "elapsed_s": time.monotonic() - t0}
        evals.append(record)
        with (run_dir / EVALS_LOG).open("a") as f:
            f.write(json.dumps(record) + "\n")
        logger.log_eval(record)
        log(f"held-out loss ({label}, step {step}): {record['held_out_loss']:.4f}")

    stream = _row_stream(rows, cfg.seed)
    records: list[dict[str, Any]] = []
    ckpt: Path | None = None
    try:
        evaluate(0, "before")
        for step in range(steps):
            t_step = time.monotonic()
            step_rows = [next(stream) for _ in range(min(cfg.sft.rows_per_step, len(rows)))]
            metrics = trainer.train_step(_micro_batches(step_rows, cfg.sft.micro_batch_rows, trainer.pad_id))
            done = step + 1
            seconds = time.monotonic() - t_step
            record = {"step": done, "epoch": done * len(step_rows) / len(rows), **metrics, "time_step_s": seconds,
                      "trained_tokens_per_s": metrics["trained_tokens"] / max(seconds, 1e-9),
                      "elapsed_s": time.monotonic() - t0}
            logger.log(record)
            records.append(record)
            log(f"step {done:>4}  loss {metrics['loss']:.4f}  grad norm {metrics['grad_norm']:.3f}  lr {metrics['lr']:.2e}")
            if cfg.sft.eval_every and done % cfg.sft.eval_every == 0 and done < steps:
                evaluate(done, "mid")
            if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == steps:
                ckpt = trainer.save_checkpoint(run_dir, done, {"tokenizer_fingerprint": fingerprint, "sft": True},
                                               cfg.checkpoint.keep_last)
        evaluate(steps, "after")
    finally:
        logger.close()
    before = next((e for e in evals if e["label"] == "before"), None)
    after = next((e for e in evals if e["label"] == "after"), None)
    summary = {
        "run_dir": str(run_dir), "model": cfg.model, "data": cfg.sft.data, "steps": steps,
        "conversations": len(train_chats), "held_out_conversations": len(held_chats), "packed_rows": len(rows),
        "conversations_cut": n_cut,
        "held_out_loss_before": before["held_out_loss"] if before else None,
        "held_out_loss_after": after["held_out_loss"] if after else None,
        "train_loss_first": records[0]["loss"] if records else None,
        "train_loss_last": records[-1]["loss"] if records else None,
        "checkpoint": str(ckpt) if ckpt else None,
        "wall_time_s": time.monotonic() - t0,
        "tokenizer_fingerprint": fingerprint,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if ckpt is not None:
        log(f"checkpoint: {ckpt}\n  continue with RL: rollwise train model={ckpt}")
    return summary
