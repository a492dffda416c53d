"""`placement: local`: the trainer, one engine (on its own thread) and the reward, all in this process."""

from __future__ import annotations

from rollwise.control.placement.base import Placement, PlaceRequest, local_trainer, placed_with_scorer, resume
from rollwise.control.sequence_budget import run_sequence_tokens
from rollwise.engine.core import EngineWorker
from rollwise.reward.pool_scorer import ScorerWithClose
from rollwise.engine.factory import create_engine, describe_engine
from rollwise.sync.senders import in_process_sender


def place_local(req: PlaceRequest) -> Placement:
    return placed_with_scorer(req, _place)


def _place(req: PlaceRequest, scorer: ScorerWithClose) -> Placement:
    cfg = req.cfg
    trainer = local_trainer(req)
    resumed = resume(trainer, req)
    # The engine copies the trainer's current weights (a resumed run's included) as it is built.
    # Invariant 1 holds by construction: trainer and engine use this one tokenizer.
    # engine.speculation=history: the engine builds its drafter and feeds it every finished sample on its
    # own thread (GRPO siblings draft from each other at once); the controller gets no drafter, since
    # feeding the same HistoryDrafter from the loop's thread would race the engine's reads.
    # Its KV cache holds max_num_seqs of the run's longest sequence, not of max_model_len (issue 41 item 7).
    engine = create_engine(cfg.engine, req.model, req.tokenizer, model_name=cfg.model, eos_token_ids=req.eos_ids,
                           policy_version=trainer.version, seed=cfg.seed, tokenizer_fingerprint=req.fingerprint,
                           sequence_tokens=run_sequence_tokens(cfg, req.tokenizer, req.problems.values()))
    return Placement(trainer, EngineWorker(engine), in_process_sender(req.fingerprint, cfg.train.lora), scorer, engine,
                     describe_engine(engine), resumed,
                     on_close=[getattr(engine, "close", lambda: None), scorer.close])  # vLLM: its weight directory
