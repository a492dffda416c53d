"""A batch's reward failures and where it was scored, for the step's metrics: `reward_errors/<kind>` (how many
samples got the error reward, by kind: rollwise.reward.pool.ErrorKind, or `verifier` for a task verifier that
failed), one reason per kind (`reward_error_reasons`, strings, in metrics.jsonl only), and the reward worker
processes that scored it (`reward_worker_pids`: empty when it was scored in the trainer's process)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollwise.reward.batch import REWARD_ERROR, REWARD_ERROR_KIND, ScoredSample
from rollwise.reward.pool import REWARD_WORKER_PID

REASON_CHARS = 300  # a reason is a line in a log, not a traceback


def reward_error_metrics(samples: Sequence[ScoredSample]) -> dict[str, Any]:
    failed = [s for s in samples if REWARD_ERROR in s.extra]
    kinds = Counter(s.extra.get(REWARD_ERROR_KIND, "verifier") for s in failed)
    out: dict[str, Any] = {f"reward_errors/{kind}": n for kind, n in sorted(kinds.items())}
    reasons: dict[str, str] = {}
    for s in failed:
        reasons.setdefault(s.extra.get(REWARD_ERROR_KIND, "verifier"), str(s.extra[REWARD_ERROR])[:REASON_CHARS])
    if reasons:
        out["reward_error_reasons"] = reasons
    out["reward_worker_pids"] = sorted({s.extra[REWARD_WORKER_PID] for s in samples if REWARD_WORKER_PID in s.extra})
    return out
