"""Train-inference mismatch and staleness corrections (`train.off_policy_correction`).

The trainer's policy before this step's update (the *proximal* policy, pi_prox) and the policy that
sampled each token (the engine's, pi_behav: an older version, or the same weights computed by another
kernel) differ. Every correction here is a per-token weight on the policy loss, a function of
rho_t = pi_prox(y_t) / pi_behav(y_t), with no gradient:

- none:       1.
- decoupled:  rho_t, capped at is_cap (AReaL's decoupled PPO).
- tis:        min(rho_t, is_cap) (truncated importance sampling, Yao et al. 2025).
- mis:        masked importance sampling (Liu, Li et al. 2025, "When Speed Kills Stability"):
    token         rho_t * 1[floor <= rho_t <= cap]
    sequence      rho(y) * 1[floor <= rho(y) <= cap] on every token of y, rho(y) = prod_t rho_t
    seq_mask_tis  rho_t * 1[floor <= rho_geo(y) <= cap], rho_geo(y) = exp(mean_t log rho_t): whole sequences
                  masked by their geometric-mean ratio, token weights kept (OpenRLHF's / NeMo RL's seq-mask-tis)
  floor defaults to 0 (the published MIS bounds only from above).
- icepop:     rho_t * 1[floor <= rho_t <= cap], floor defaulting to 0.5 (IcePop, Ling team 2025: a two-sided
              token mask; the paper used [0.5, 5]).

A masked token's weight is exactly 0, whatever its ratio (0, inf or NaN from -inf log-probs): masks are
applied with `where`, never by multiplying. `Correction.kept` says which tokens survived; the trainer
logs the masked fraction (`is_masked_fraction`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollwise.types.algorithms import MIS_LEVELS, OFF_POLICY_CORRECTIONS

DEFAULT_FLOOR = {"mis": 0.0, "icepop": 0.5}
MASKING = ("mis", "icepop")  # the corrections that can drop tokens


@dataclass(frozen=True)
class Correction:
    weights: Tensor  # [N] per-token weight on the loss, no grad; exactly 0 where masked
    kept: Tensor  # [N] bool: False where the correction masked the token (or its sequence) out

    @property
    def masked_tokens(self) -> int:
        return int((~self.kept).sum())


def seq_sum(values: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """[num_seqs] sums of `values` [N] over each sequence's tokens (seq_index [N] in 0..num_seqs-1)."""
    return torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq_index, values)


def _in_bounds(x: Tensor, floor: float, cap: float) -> Tensor:
    return (x >= floor) & (x <= cap)  # NaN is in no bounds: masked


def correction(proximal_logp: Tensor, behaviour_logp: Tensor, mode: str, *, cap: float | None,
               floor: float | None = None, level: str = "token", seq_index: Tensor | None = None,
               num_seqs: int = 0) -> Correction:
    """The per-token weights of correction `mode` (train.off_policy_correction) for these tokens.
    `seq_index`/`num_seqs` (each token's sequence within the batch) are needed by mis's sequence levels."""
    ones = torch.ones_like(behaviour_logp)
    kept_all = torch.ones_like(behaviour_logp, dtype=torch.bool)
    if mode == "none":
        return Correction(ones, kept_all)
    log_rho = (proximal_logp - behaviour_logp).detach()
    rho = torch.exp(log_rho)
    if mode == "tis":
        if cap is None:
            raise ValueError("tis needs a cap (train.is_cap)")
        return Correction(rho.clamp(max=cap), kept_all)
    if mode == "decoupled":
        return Correction(rho if cap is None else rho.clamp(max=cap), kept_all)
    if mode not in MASKING:
        raise ValueError(f"train.off_policy_correction={mode!r}: choose one of "
                         f"{', '.join(c for c in OFF_POLICY_CORRECTIONS if c != 'auto')}")
    if cap is None:
        raise ValueError(f"{mode} needs an upper bound (train.is_cap)")
    lo = DEFAULT_FLOOR[mode] if floor is None else floor
    zero = torch.zeros_like(rho)
    if mode == "icepop" or level == "token":
        kept = _in_bounds(rho, lo, cap)
        return Correction(torch.where(kept, rho, zero), kept)
    if level not in MIS_LEVELS:
        raise ValueError(f"train.mis_level={level!r}: choose one of {', '.join(MIS_LEVELS)}")
    if seq_index is None:
        raise ValueError(f"mis at level {level} needs each token's sequence (seq_index)")
    sums = seq_sum(log_rho, seq_index, num_seqs)
    if level == "sequence":
        seq_rho = torch.exp(sums)
        kept = _in_bounds(seq_rho, lo, cap)[seq_index]
        return Correction(torch.where(kept, seq_rho[seq_index], zero), kept)
    counts = seq_sum(ones, seq_index, num_seqs).clamp(min=1.0)
    kept = _in_bounds(torch.exp(sums / counts), lo, cap)[seq_index]  # seq_mask_tis: geometric mean
    return Correction(torch.where(kept, rho, zero), kept)
