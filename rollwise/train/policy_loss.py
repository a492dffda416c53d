"""Policy losses (`train.policy_loss`): a micro-batch's trained tokens -> its share of the batch loss.

Each built-in loss is a pure function of a typed batch (`PolicyLossInputs`) returning a per-token loss;
`PolicyLoss.terms` then applies, the same way for all of them, the off-policy correction's weights
(rollwise.train.corrections), the k3 KL to the reference (train.kl_coef) and the batch weights
(rollwise.train.grpo.token_weights), so gradient accumulation over micro-batches equals one big batch.
With r_t = pi(y_t) / pi_old(y_t) (pi_old: the proximal policy with a correction, else the sampler's) and
A the advantage:

- ppo_clip:  -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)  (PPO; DAPO's clip-higher bounds).
- dual_clip: ppo_clip, and for A < 0 at most dual_clip_c * |A| (Ye et al. 2020, dual-clip PPO).
- gspo:      the sequence ratio s = exp(mean_t log r_t) clipped as PPO's, in its token form
             s_t = sg(s) * pi(y_t) / sg(pi(y_t)) (GSPO, Zheng et al. 2025): equal value, and the gradient of the
             sequence objective. With train.loss_agg=seq_mean_token_mean every sequence counts once, as in
             the paper; token_mean weighs sequences by length.
- cispo:     -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi(y_t) (CISPO, MiniMax-M1 2025): every
             token keeps a gradient, its IS weight clipped.
- custom:    "module:function" (or "path/to/file.py:function"): function(batch: PolicyLossInputs) -> a scalar
             tensor, this micro-batch's share of the loss (see examples/custom_loss.py). It is imported and
             called on a small dummy batch when the trainer is built (`resolve_policy_loss`): a bad path, an
             exception, a non-scalar, a NaN/inf or a loss whose gradient does not reach batch.logp is a
             ConfigError naming train.policy_loss, before any step runs.

Log-ratios are held at MAX_LOG_RATIO (e^80, below float32 overflow): a token whose old probability was 0
gets a finite loss and no gradient through its ratio, instead of inf and a NaN gradient (0 * inf);
every ratio that does not overflow is computed exactly as without the bound.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from rollwise.config import ConfigError
from rollwise.types.train_config import TrainConfig
from rollwise.train.corrections import seq_sum
from rollwise.types.algorithms import POLICY_LOSSES, did_you_mean, is_custom_loss

MAX_LOG_RATIO = 80.0


@dataclass(frozen=True)
class PolicyLossInputs:
    """One micro-batch's trained tokens, flattened sample after sample (the typed batch a custom loss gets).
    All [N] tensors are on the trainer's device; only `logp` carries a gradient."""

    logp: Tensor  # [N] log pi(y_t) of the policy being trained, now (requires grad)
    behaviour_logp: Tensor  # [N] log-probs at sampling (the engine's, for the policy version that sampled)
    old_logp: Tensor  # [N] the ratio's denominator: the proximal policy's log-probs (before this step's
    #                     update) when a correction is on, else behaviour_logp
    advantages: Tensor  # [N] each sample's advantage on its tokens
    token_weights: Tensor  # [N] each token's share of the *batch* loss (sums to 1 over all micro-batches)
    is_weights: Tensor  # [N] the off-policy correction's weight (1 without one; 0 on masked tokens)
    kept: Tensor  # [N] bool: False on tokens the correction masked out (mis, icepop)
    seq_index: Tensor  # [N] long: each token's sample within this micro-batch, 0..num_seqs-1
    num_seqs: int
    versions: Tensor  # [N] long: the policy version that sampled each token
    policy_version: int  # the trainer's policy version now (optimizer updates so far)

    def seq_sum(self, values: Tensor) -> Tensor:
        """[num_seqs] sums of a per-token tensor over each sample's tokens."""
        return seq_sum(values, self.seq_index, self.num_seqs)

    def seq_mean(self, values: Tensor) -> Tensor:
        """[num_seqs] means of a per-token tensor over each sample's tokens."""
        return self.seq_sum(values) / self.seq_sum(torch.ones_like(values)).clamp(min=1.0)

    def per_token(self, per_seq: Tensor) -> Tensor:
        """[N] a per-sample value [num_seqs] on each of its tokens."""
        return per_seq[self.seq_index]

    def batch_loss(self, per_token: Tensor) -> Tensor:
        """This micro-batch's share of the batch loss for a per-token loss: the sum weighted by token_weights."""
        return (per_token * self.token_weights).sum()


@dataclass(frozen=True)
class ClipSettings:
    clip_low: float
    clip_high: float
    dual_clip_c: float = 3.0


@dataclass(frozen=True)
class TokenLoss:
    per_token: Tensor  # [N] loss per token, before the correction's weights and the batch weights
    clipped: Tensor  # [N] bool: where a clip bound was active (the clip_fraction metric)


@dataclass
class LossTerms:
    loss: Tensor  # scalar to backpropagate (already divided by the batch's normaliser)
    clipped_tokens: Tensor  # count of tokens where the clip was active
    kl_sum: Tensor  # sum of k3 KL over tokens (0 when no reference)


BuiltinLoss = Callable[[PolicyLossInputs, ClipSettings], TokenLoss]
CustomLoss = Callable[[PolicyLossInputs], Tensor]


def ratio(batch: PolicyLossInputs) -> Tensor:
    """r_t = pi / pi_old, its log held at MAX_LOG_RATIO (see the module doc)."""
    return torch.exp(torch.clamp(batch.logp - batch.old_logp, max=MAX_LOG_RATIO))


def ppo_clip(batch: PolicyLossInputs, clip: ClipSettings) -> TokenLoss:
    r = ratio(batch)
    unclipped = r * batch.advantages
    clipped = torch.clamp(r, 1.0 - clip.clip_low, 1.0 + clip.clip_high) * batch.advantages
    return TokenLoss(-torch.minimum(unclipped, clipped), clipped < unclipped)


def dual_clip(batch: PolicyLossInputs, clip: ClipSettings) -> TokenLoss:
    ppo = ppo_clip(batch, clip)
    bound = -clip.dual_clip_c * batch.advantages  # c * |A| where A < 0
    negative = batch.advantages < 0
    capped = negative & (ppo.per_token > bound)
    return TokenLoss(torch.where(capped, bound, ppo.per_token), ppo.clipped | capped)


def gspo(batch: PolicyLossInputs, clip: ClipSettings) -> TokenLoss:
    log_r = torch.clamp(batch.logp - batch.old_logp, max=MAX_LOG_RATIO)
    seq_log_r = batch.seq_mean(log_r.detach())
    # s_t: value s (the sequence's length-normalised ratio), gradient s * grad log pi(y_t)
    s = torch.exp(batch.per_token(seq_log_r) + batch.logp - batch.logp.detach())
    unclipped = s * batch.advantages
    clipped = torch.clamp(s, 1.0 - clip.clip_low, 1.0 + clip.clip_high) * batch.advantages
    return TokenLoss(-torch.minimum(unclipped, clipped), clipped < unclipped)


def cispo(batch: PolicyLossInputs, clip: ClipSettings) -> TokenLoss:
    r = ratio(batch).detach()
    weight = torch.clamp(r, 1.0 - clip.clip_low, 1.0 + clip.clip_high)
    return TokenLoss(-weight * batch.advantages * batch.logp, weight != r)


BUILTIN: dict[str, BuiltinLoss] = {"ppo_clip": ppo_clip, "dual_clip": dual_clip, "gspo": gspo, "cispo": cispo}
assert tuple(BUILTIN) == POLICY_LOSSES, "rollwise.types.algorithms lists the same names"


@dataclass(frozen=True)
class PolicyLoss:
    """train.policy_loss resolved: a built-in token loss or a custom function, and how terms() combines it."""

    name: str
    clip: ClipSettings
    builtin: BuiltinLoss | None = None
    custom: CustomLoss | None = None

    def terms(self, batch: PolicyLossInputs, *, corrected: bool, masked: bool,
              ref_logp: Tensor | None = None, kl_coef: float = 0.0) -> LossTerms:
        """The micro-batch's loss: the policy loss, weighted by the correction (`corrected`: one is on;
        `masked`: it may have masked tokens), plus kl_coef x the k3 KL to the reference, weighted by
        token_weights. A custom loss applies the correction itself (batch.is_weights)."""
        kl_sum = torch.zeros((), dtype=batch.logp.dtype)
        kl = None
        if ref_logp is not None and kl_coef > 0:
            # k3 estimator of KL(pi || ref): unbiased, always >= 0, low variance (Schulman 2020).
            log_ratio_ref = ref_logp - batch.logp
            kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
            kl_sum = kl.detach().sum()
        if self.custom is not None:
            loss = self.custom(batch)
            if not isinstance(loss, Tensor) or loss.dim() != 0:
                raise ValueError(f"train.policy_loss={self.name!r} returned {_describe(loss)}, not a scalar tensor")
            if kl is not None:
                loss = loss + ((kl_coef * kl) * batch.token_weights).sum()
            return LossTerms(loss=loss, clipped_tokens=torch.zeros((), dtype=torch.long), kl_sum=kl_sum)
        assert self.builtin is not None
        out = self.builtin(batch, self.clip)
        per_token = out.per_token
        if masked:  # where, not a product: a masked token's loss may be inf or NaN, its weight is 0
            per_token = torch.where(batch.kept, per_token * batch.is_weights.detach(), torch.zeros_like(per_token))
        elif corrected:
            per_token = per_token * batch.is_weights.detach()
        if kl is not None:
            per_token = per_token + kl_coef * kl
        loss = (per_token * batch.token_weights).sum()
        return LossTerms(loss=loss, clipped_tokens=out.clipped.sum(), kl_sum=kl_sum)


def resolve_policy_loss(cfg: TrainConfig) -> PolicyLoss:
    """train.policy_loss as a PolicyLoss; a custom one is imported and checked on a dummy batch first (a
    ConfigError naming the field when it cannot be used)."""
    clip = ClipSettings(cfg.clip_low, cfg.clip_high, cfg.dual_clip_c)
    name = cfg.policy_loss
    if not is_custom_loss(name):
        if name not in BUILTIN:
            raise ConfigError(f"train.policy_loss={name!r}: unknown loss; choose one of {', '.join(BUILTIN)}, or "
                              f"module:function of a custom one.{did_you_mean(name, POLICY_LOSSES)}")
        return PolicyLoss(name, clip, builtin=BUILTIN[name])
    fn = load_custom_loss(name)
    check_custom_loss(name, fn)
    return PolicyLoss(name, clip, custom=fn)


def _refuse(spec: str, why: str) -> ConfigError:
    return ConfigError(f"train.policy_loss={spec!r}: {why}")


def _import(spec: str, module_name: str) -> ModuleType:
    try:
        if module_name.endswith(".py"):  # a file: path/to/loss.py:function
            path = Path(module_name).expanduser().resolve()
            if not path.is_file():
                raise _refuse(spec, f"no file {str(path)!r}: give an existing .py file, or module:function")
            name = f"rollwise_custom_loss_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            sys.modules[name] = module  # as an imported module is (pickling, introspection)
            return module
        if os.getcwd() not in sys.path:  # a module in the directory the run starts from, as `python -m` finds it
            sys.path.append(os.getcwd())
        return importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:  # its import is user code: any error is the config's to report
        raise _refuse(spec, f"cannot import {module_name!r} ({type(exc).__name__}: {exc}); give an importable "
                      "module (from the working directory or the Python path) or a .py file, as module:function"
                      ) from None


def load_custom_loss(spec: str) -> CustomLoss:
    """The function a "module:function" (or "file.py:function") names; ConfigError naming the field if not."""
    module_name, _, fn_name = spec.rpartition(":")
    module = _import(spec, module_name)
    fn = getattr(module, fn_name, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise _refuse(spec, f"{module_name!r} has no {fn_name!r}.{did_you_mean(fn_name, tuple(names))}")
    if not callable(fn):
        raise _refuse(spec, f"{module_name}.{fn_name} is a {type(fn).__name__}, not a function")
    return fn


def dummy_batch() -> PolicyLossInputs:
    """Two samples (3 and 2 tokens), slightly off-policy, positive and negative advantages: what a custom
    loss is tried on before any step."""
    logp = torch.log(torch.tensor([0.5, 0.25, 0.8, 0.6, 0.3])).requires_grad_(True)
    behaviour = logp.detach() + torch.tensor([0.05, -0.1, 0.0, 0.2, -0.05])
    return PolicyLossInputs(
        logp=logp, behaviour_logp=behaviour, old_logp=behaviour, advantages=torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0]),
        token_weights=torch.full((5,), 0.2), is_weights=torch.ones(5), kept=torch.ones(5, dtype=torch.bool),
        seq_index=torch.tensor([0, 0, 0, 1, 1]), num_seqs=2, versions=torch.zeros(5, dtype=torch.long),
        policy_version=0)


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def check_custom_loss(spec: str, fn: CustomLoss) -> None:
    """Call `fn` on the dummy batch: it must return a finite scalar tensor whose gradient reaches batch.logp."""
    batch = dummy_batch()
    try:
        loss = fn(batch)
    except Exception as exc:  # user code
        raise _refuse(spec, f"raised {type(exc).__name__}: {exc} on a dummy batch of 2 samples "
                      "(rollwise.train.policy_loss.dummy_batch)") from None
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise _refuse(spec, f"returned {_describe(loss)} on a dummy batch; a loss must return a scalar tensor "
                      "(e.g. batch.batch_loss(per_token))")
    if not math.isfinite(float(loss.detach())):
        raise _refuse(spec, f"returned {float(loss.detach())} on a dummy batch; a loss must be finite")
    if not loss.requires_grad:
        raise _refuse(spec, "returned a loss with no gradient on a dummy batch: it must depend on batch.logp, "
                      "or the weights never learn")
    (grad,) = torch.autograd.grad(loss, batch.logp, allow_unused=True)
    if grad is None:
        raise _refuse(spec, "returned a loss that does not depend on batch.logp: its gradient would not reach "
                      "the weights")
    if not bool(torch.isfinite(grad).all()):
        raise _refuse(spec, "has a NaN or infinite gradient on a dummy batch")
