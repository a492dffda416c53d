"""In-process weight push for callers that hold a model and engines (or EngineWorkers) directly.

Kept for tests and benchmarks that drive engines by hand: it goes through the same checked path as
training (`WeightUpdate.of_state` + `WeightReceiver.receive`: the whole update is checked against
the engine's model before any weight is written). The training loop itself pushes through its
placement's WeightSender (rollwise.sync.senders) to its RolloutBackend.
"""

from __future__ import annotations

from torch import nn

from rollwise.types.contracts import WeightEngine
from rollwise.types.weight_update import WeightUpdate
from rollwise.engine.weight_receiver import WeightReceiver


def push_weights(model: nn.Module, engines: list[WeightEngine], version: int, tokenizer_fingerprint: str | None = None) -> None:
    """Push `model`'s weights as `version` to each engine (or EngineWorker). Without a fingerprint the
    receivers check everything but the tokenizer (the engines were built from the same objects)."""
    update = WeightUpdate.of_state(model.state_dict(), version, tokenizer_fingerprint)
    for engine in engines:
        WeightReceiver(engine, tokenizer_fingerprint).receive(update)
