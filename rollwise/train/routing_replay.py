"""Rollout routing replay (R3, arXiv 2510.11370) for mixture-of-experts policies in the trainer.

The engine and the trainer compute router logits with different kernels and precisions, so they can
pick different experts for the same token: the trainer then scores tokens with a different network
than the one that sampled them. R3 makes the trainer's forward use the experts the engine recorded
(`Sample.routed_experts`), while the gate weights come from the trainer's own router logits at those
experts (softmax over the chosen k, as Mixtral's router computes them), so the router still learns.

How it hooks in: a forward hook on every router module (HF's `mlp.gate`, which returns
`(router_logits, top_k_weights, top_k_index)`) swaps in the recorded experts. Each backbone call of a
micro-batch gets one record [tokens, layers, top_k] (the padded forward has one call; the shared-prompt
forward has two: the prompt, then the responses). A record is consumed exactly once per forward: a
router that runs with no record left is an error, and so is a record left unconsumed. Activation
checkpointing recomputes layers during backward; that recompute is served the very experts the forward
used (kept per layer, in call order), never a fresh routing.

Positions marked -1 (padding, and each sample's last token, which the engine never ran a forward on)
route by the live logits: their outputs reach no trained log-prob (attention is causal). With
`train.routing_replay: none` the same hooks only observe, so the mismatch metrics (router
disagreement) are measured with and without replay alike.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollwise.types.sample import Sample

ReplayMode = Literal["none", "r3"]
FREE = -1  # a position with no record: route by the live logits (see the module docstring)


@dataclass
class ReplayBatch:
    """The records of one micro-batch: one tensor [tokens, layers, top_k] per backbone call, in call order."""

    calls: list[Tensor]
    samples: list[Sample] = field(repr=False)

    def check(self, num_layers: int, top_k: int, num_experts: int) -> None:
        """Every sample's record matches the model; a bad one is refused naming the sample."""
        for s in self.samples:
            r = s.routed_experts
            if r.num_layers != num_layers or r.top_k != top_k:
                raise ValueError(f"sample {s.sample_id}: routed_experts has {r.num_layers} layers x top-{r.top_k}, "
                                 f"but the model has {num_layers} MoE layers x top-{top_k} (was it sampled by "
                                 "another model?)")
            experts = r.array()
            if experts.size and (experts.min() < 0 or experts.max() >= num_experts):
                raise ValueError(f"sample {s.sample_id}: routed_experts names expert ids outside "
                                 f"[0, {num_experts}) (min {experts.min()}, max {experts.max()})")


def _records(s: Sample) -> Tensor:
    """A sample's record as int64 [prompt + response - 1, layers, top_k], its length checked."""
    if s.routed_experts is None:
        raise ValueError(f"sample {s.sample_id}: no routed_experts, but train.routing_replay=r3 replays the "
                         "engine's routing (serve a mixture-of-experts model on an engine that captures routing, "
                         "or set train.routing_replay=none)")
    expected = len(s.prompt_ids) + len(s.response_ids) - 1
    if s.routed_experts.num_tokens != expected:
        raise ValueError(f"sample {s.sample_id}: routed_experts covers {s.routed_experts.num_tokens} tokens, "
                         f"expected len(prompt) + len(response) - 1 = {expected}")
    return torch.from_numpy(s.routed_experts.array().astype("int64"))


def rows_batch(samples: list[Sample], length: int) -> ReplayBatch:
    """Records for right-padded prompt + response rows of `length` (rollwise.train.trainer.collate);
    no records when no sample carries routing (a dense model, or an engine that captures none)."""
    if all(s.routed_experts is None for s in samples):
        return ReplayBatch([], samples)
    recs = [_records(s) for s in samples]
    _, layers, k = recs[0].shape
    out = torch.full((len(samples), length, layers, k), FREE, dtype=torch.long)
    for row, rec in enumerate(recs):
        out[row, : rec.shape[0]] = rec
    return ReplayBatch([out.view(-1, layers, k)], samples)


def group_batch(samples: list[Sample], response_length: int) -> ReplayBatch:
    """Records for a shared-prompt group (rollwise.train.trainer.collate_group): the prompt's (from the
    first sample; the group's samples share the prompt), then the right-padded responses'."""
    if all(s.routed_experts is None for s in samples):
        return ReplayBatch([], samples)
    recs = [_records(s) for s in samples]
    prompt_len = len(samples[0].prompt_ids)
    _, layers, k = recs[0].shape
    responses = torch.full((len(samples), response_length, layers, k), FREE, dtype=torch.long)
    for row, rec in enumerate(recs):
        tail = rec[prompt_len:]  # response token j sits at row prompt_len + j; the last has none
        responses[row, : tail.shape[0]] = tail
    return ReplayBatch([recs[0][:prompt_len], responses.view(-1, layers, k)], samples)


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE layer, in layer order (HF Mixtral/Qwen-MoE style `mlp.gate` with top_k)."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "weight")]


def _in_backward() -> bool:
    """True while autograd runs a backward pass (where activation checkpointing recomputes layers)."""
    return torch._C._current_graph_task_id() != -1


class RoutingReplay:
    """Forward hooks on a model's routers: replay recorded experts (r3) or only observe (none)."""

    def __init__(self, model: nn.Module, mode: ReplayMode) -> None:
        self.mode = mode
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError("train.routing_replay=r3 needs a mixture-of-experts model (none of its modules is a "
                             "top-k router `mlp.gate`); set train.routing_replay=none for dense models")
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].weight.shape[0]
        self._pending: list[deque[Tensor]] = [deque() for _ in self.routers]
        self._used: list[deque[Tensor]] = [deque() for _ in self.routers]  # served again in a recompute
        self._disagree: dict[int, Tensor] = {}  # call index -> per-token "any layer disagrees"
        self._calls = [0] * len(self.routers)
        self.recomputed_calls = 0  # router calls served again in activation checkpointing's recompute
        self.collect_aux = False  # keep router logits for the load-balancing loss (train.router_aux_loss_coef > 0)
        self._aux: list[tuple[Tensor, Tensor, Tensor | None]] = []  # (logits, experts used, valid tokens)
        self.reset_metrics()
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    # ------------------------------------------------------------ one forward

    def begin(self, batch: ReplayBatch | None) -> None:
        """Queue a micro-batch's records before its forward (None or no records: no routing was captured)."""
        if (batch is None or not batch.calls) and self.mode == "r3":
            names = ", ".join(s.sample_id for s in batch.samples[:3]) if batch is not None else "(unknown)"
            raise ValueError(f"train.routing_replay=r3: samples {names} carry no routed_experts (the engine "
                             "captured no routing: vLLM on CPU cannot, see docs/benchmarks.md); use an engine that "
                             "captures routing (engine.kind=reference) or set train.routing_replay=none")
        for queue in self._pending + self._used:
            queue.clear()
        self._calls = [0] * len(self.routers)
        self._disagree = {}
        self._aux = []
        if batch is None or not batch.calls:
            return
        batch.check(len(self.routers), self.top_k, self.num_experts)
        for layer, queue in enumerate(self._pending):
            queue.extend(call[:, layer] for call in batch.calls)

    def end(self) -> None:
        """After the forward: every record consumed exactly once, and the per-token metrics tallied."""
        left = sum(len(q) for q in self._pending)
        if left:
            raise RuntimeError(f"routing replay: {left} (layer, call) records were not consumed by the forward "
                               "(the forward ran fewer router calls than the micro-batch has records)")
        for any_used, any_live, valid in self._disagree.values():
            self.tokens_any += int(any_used.sum())
            self.tokens_any_live += int(any_live.sum())
            self.tokens += int(valid.sum())
        self._disagree = {}

    # ------------------------------------------------------------ metrics

    def reset_metrics(self) -> None:
        self.pairs = self.pairs_disagree = self.pairs_disagree_live = 0
        self.tokens = self.tokens_any = self.tokens_any_live = 0

    def take_metrics(self) -> dict[str, float]:
        """Since the last call (DESIGN.md 'Routing disagreement'): the share of recorded (token, layer) pairs
        where the experts the trainer's forward used differ from the engine's (0 under R3), and the share of
        tokens with any layer differing; `_live`: the same for the trainer's own router, replay or not."""
        out = {"routing_disagreement": self.pairs_disagree / max(self.pairs, 1),
               "routing_tokens_any_disagree": self.tokens_any / max(self.tokens, 1),
               "routing_disagreement_live": self.pairs_disagree_live / max(self.pairs, 1),
               "routing_tokens_any_disagree_live": self.tokens_any_live / max(self.tokens, 1),
               "routing_replayed": float(self.mode == "r3")}
        self.reset_metrics()
        return out

    # ------------------------------------------------------------ the hook

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs: tuple, output: tuple) -> tuple | None:
            logits = output[0]
            if _in_backward():  # activation checkpointing's recompute: the experts the forward used
                if not self._used[layer]:
                    raise RuntimeError(f"routing replay: layer {layer} recomputed with no forward routing to reuse")
                experts = self._used[layer].popleft()
                self.recomputed_calls += 1
                return (logits, self._gate_weights(logits, experts).to(output[1].dtype), experts)
            if not self._pending[layer]:
                if self.mode == "r3":
                    raise RuntimeError(f"routing replay: layer {layer}'s router ran with no record left "
                                       "(a forward outside begin()/end(), or more router calls than records)")
                if self.collect_aux and torch.is_grad_enabled():
                    self._aux.append((logits, output[2], None))
                return None  # observe mode, nothing captured: plain routing
            record = self._pending[layer].popleft()
            if record.shape[0] != logits.shape[0]:
                raise RuntimeError(f"routing replay: layer {layer} routes {logits.shape[0]} tokens but its record "
                                   f"has {record.shape[0]}")
            record = record.to(logits.device)
            live = output[2]
            experts = torch.where(record >= 0, record, live) if self.mode == "r3" else live
            self._tally(layer, record, live, experts)
            if self.collect_aux and torch.is_grad_enabled():
                self._aux.append((logits, experts, record[:, 0] >= 0))
            if self.mode != "r3":
                return None
            self._used[layer].append(experts)  # (a reentrant checkpoint's forward runs without grad: keep always)
            return (logits, self._gate_weights(logits, experts).to(output[1].dtype), experts)

        return hook

    def aux_loss(self) -> Tensor | None:
        """The load-balancing loss of the latest forward (Switch Transformer / Mixtral): num_experts x
        sum over experts of (share of routed slots on the expert) x (its mean router probability), averaged
        over router calls, on recorded tokens (padding excluded); None when no router ran with grad."""
        terms = []
        for logits, experts, valid in self._aux:
            if valid is not None:
                logits, experts = logits[valid], experts[valid]
            if logits.shape[0]:
                probs = torch.softmax(logits.float(), dim=-1)
                share = F.one_hot(experts, self.num_experts).float().mean(dim=(0, 1))
                terms.append(self.num_experts * (share * probs.mean(dim=0)).sum())
        self._aux = []
        return torch.stack(terms).mean() if terms else None

    @staticmethod
    def _gate_weights(logits: Tensor, experts: Tensor) -> Tensor:
        """Mixtral's gate weights at given experts: softmax probabilities renormalised over the k chosen,
        from the live logits (so gradients reach the router)."""
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
        return probs / probs.sum(dim=-1, keepdim=True)

    def _tally(self, layer: int, record: Tensor, live: Tensor, used: Tensor) -> None:
        valid = record[:, 0] >= 0
        recorded = record.sort(dim=-1).values

        def differs(experts: Tensor) -> Tensor:  # per token: another set of experts than the engine's
            return (recorded != experts.sort(dim=-1).values).any(dim=-1) & valid

        used_differs, live_differs = differs(used), differs(live)
        self.pairs += int(valid.sum())
        self.pairs_disagree += int(used_differs.sum())
        self.pairs_disagree_live += int(live_differs.sum())
        call = self._calls[layer]
        self._calls[layer] += 1
        if call not in self._disagree:  # the first layer of a call: per-token flags over all layers
            self._disagree[call] = (torch.zeros_like(valid), torch.zeros_like(valid), valid.clone())
        self._disagree[call][0].logical_or_(used_differs)
        self._disagree[call][1].logical_or_(live_differs)
