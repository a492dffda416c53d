"""Long responses without running out of memory (issue 41 item 7): log-probs and entropy in chunks of
tokens (values and gradients against a plain full-vocabulary log_softmax), their memory bounded by a
chunk, activation checkpointing over the shared-prompt KV cache (train.gradient_checkpointing), micro-
batches cut to train.micro_batch_tokens, and the vLLM KV cache sized to the run."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # torch's own (private) dispatch-mode base
from torch.utils._pytree import tree_leaves

from rollwise.types.train_config import TrainConfig
from rollwise.engine.vllm_startup import kv_cache_blocks_for_run
from rollwise.model.tiny import tiny_llama
from rollwise.train.logprobs import LogprobOptions, lm_head_logprobs, sequence_logprobs
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.microbatch import chunk_samples, computed_tokens
from rollwise.types.sample import Sample

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _plain(model, input_ids, target_mask, temperature):
    """Independent: the whole [rows, T, vocab] logits, log_softmax, gather, entropy."""
    logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits.float() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = target_mask[:, 1:]
    return logp[mask], entropy[mask]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 1000])  # one row at a time; boundaries inside sequences; one chunk
def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax(fused, chunk_tokens):
    model = tiny_llama(seed=5)
    input_ids = torch.randint(3, 90, (3, 13), generator=torch.Generator().manual_seed(1))
    target_mask = torch.zeros(3, 13, dtype=torch.bool)
    target_mask[0, 4:] = True
    target_mask[1, 2:9] = True  # masked tokens at the end of a row
    target_mask[2, [3, 5, 6, 11]] = True  # holes (tool tokens of a multi-turn sample)
    n = int(target_mask[:, 1:].sum())
    assert n % 7 != 0  # the last chunk is a partial one
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(2))

    def grads(logp):
        model.zero_grad()
        (logp * upstream).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    want_logp, want_entropy = _plain(model, input_ids, target_mask, 0.8)
    want = grads(want_logp)
    got_logp, got_entropy = sequence_logprobs(model, input_ids, torch.ones_like(input_ids), target_mask,
                                              LogprobOptions(0.8, chunk_tokens, fused))
    got = grads(got_logp)
    assert _rel(got_logp, want_logp) < 1e-5 and _rel(got_entropy, want_entropy.detach()) < 1e-5
    for name in want:
        assert _rel(got[name], want[name]) < 1e-5, name


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active (forward and, on CPU, the backward the
    calling thread runs): what "never a whole batch's tokens x vocabulary tensor at once" is about, counted
    exactly, whatever else the process or the machine holds."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("fused", [False, True])
def test_chunked_logprobs_never_hold_the_whole_logits(fused):
    """1024 tokens x a 150,000-word vocabulary: the logits alone are 586 MiB in fp32. No op of the chunked
    forward + backward makes a tensor larger than a few chunks' [64, vocab] rows (37 MiB each). (A process's
    resident high-water mark measured this before; in the full suite, earlier tests' allocator state made it
    unreliable.)"""
    tokens, vocab, chunk = 1024, 150_000, 64
    lm_head = torch.nn.Linear(8, vocab, bias=False)
    hidden = torch.randn(tokens, 8, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    full_logits = tokens * vocab * 4
    with _LargestTensor() as watch:
        logp, entropy = lm_head_logprobs(hidden, lm_head, targets, LogprobOptions(chunk_tokens=chunk, fused=fused))
        logp.sum().backward()
    assert torch.isfinite(hidden.grad).all() and entropy.shape == (tokens,)
    assert watch.largest >= chunk * vocab * 4  # it saw the chunks' logits (the watch works)
    assert watch.largest < full_logits / 8, f"a {watch.largest / 2**20:.0f} MiB tensor for {full_logits / 2**20:.0f} MiB of logits"
    # the plain computation does make one: the check can fail
    with _LargestTensor() as plain:
        torch.log_softmax(lm_head(hidden.detach()), dim=-1)
    assert plain.largest >= full_logits


def _groups(seed: int, groups: int, size: int, lengths: tuple[int, int]) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 90) for _ in range(rng.randint(3, 8))]
        for i in range(size):
            response = [rng.randrange(3, 90) for _ in range(rng.randint(*lengths))]
            out.append(Sample(f"{g}/{i}", str(g), str(g), prompt, response, [rng.uniform(-5, -1) for _ in response],
                              [0] * len(response), "stop", advantage=rng.uniform(-1, 1)))
    return out


def _step_grads(cfg: TrainConfig, samples: list[Sample], calls: list[int] | None = None):
    trainer = GRPOTrainer(tiny_llama(seed=3), cfg, pad_token_id=0)
    if calls is not None:  # how often a layer's MLP starts: twice per forward when it is recomputed (a pre-hook:
        # the recompute stops once the last saved tensor is back, before the MLP's forward hooks would run)
        trainer.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    got: dict[str, torch.Tensor] = {}
    trainer.before_step = lambda m: got.update({n: p.grad.clone() for n, p in m.named_parameters()})
    metrics = trainer.train_step(samples)
    return got, metrics, len(chunk_samples(samples, cfg)[1])


class _BackwardOpCounts(TorchDispatchMode):
    """How often each op ran while active, once `in_backward` is set."""

    def __init__(self):
        super().__init__()
        self.in_backward = False
        self.backward: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_backward:
            name = func.overloadpacket.__name__
            self.backward[name] = self.backward.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_op_counts(mode) -> dict[str, int]:
    """Ops run in one micro-batch's backward (one group, prompt shared) under train.gradient_checkpointing=`mode`."""
    samples = _groups(seed=1, groups=1, size=3, lengths=(4, 9))
    trainer = GRPOTrainer(tiny_llama(seed=3), TrainConfig(lr=1e-3, micro_batch_size=3, off_policy_correction="none",
                                                          gradient_checkpointing=mode), pad_token_id=0)
    counts = _BackwardOpCounts()
    # the switch: the final norm's backward pre-hook (the LM head's gradient is computed from its weight, outside
    # the module; the decoder layers' backward, recompute included, comes after the final norm's)
    trainer.model.model.norm.register_full_backward_pre_hook(lambda *_: setattr(counts, "in_backward", True))
    with counts:
        trainer.train_step(samples)
    return counts.backward


def test_selective_checkpointing_recomputes_the_cheap_ops_and_not_the_matmuls():
    """'selective' keeps the matmuls' and attention's outputs: its backward runs the matmuls a plain backward runs
    (none recomputed, where full checkpointing reruns every forward one) and recomputes the norms."""
    plain, full, selective = (_backward_op_counts(mode) for mode in (False, True, "selective"))
    matmuls = ("mm", "addmm", "bmm")
    count = lambda counts, ops: sum(counts.get(op, 0) for op in ops)  # noqa: E731
    assert count(full, matmuls) > count(plain, matmuls)  # full recompute reruns the layers' projections
    assert count(selective, matmuls) == count(plain, matmuls)
    assert full.get("rsqrt", 0) > plain.get("rsqrt", 0) and selective.get("rsqrt", 0) == full.get("rsqrt", 0)
    attention = [op for op in full if "scaled_dot_product" in op and "backward" not in op]
    assert attention and all(selective.get(op, 0) == plain.get(op, 0) == 0 for op in attention)


@pytest.mark.parametrize("mode", [True, "selective"])
@pytest.mark.parametrize("layout", [dict(share_prompt_prefix=True, pack_responses=True, pack_groups=True),
                                    dict(share_prompt_prefix=True, pack_responses=False),
                                    dict(share_prompt_prefix=False)])
def test_activation_checkpointing_recomputes_layers_and_gives_the_same_step(layout, mode):
    """Shared-prompt forwards keep the prompt's KV cache under checkpointing, full or selective (Hugging Face's
    switch drops it; the config used to refuse the combination): same gradients, loss and entropy, layers run
    twice."""
    samples = _groups(seed=1, groups=3, size=3, lengths=(2, 11))
    base = dict(lr=1e-3, micro_batch_size=3, off_policy_correction="none", kl_coef=0.05, **layout)
    plain_calls: list[int] = []
    want, want_metrics, micro_batches = _step_grads(TrainConfig(**base), samples, plain_calls)
    calls: list[int] = []
    got, got_metrics, _ = _step_grads(TrainConfig(**base, gradient_checkpointing=mode), samples, calls)
    assert len(plain_calls) == micro_batches * (2 if layout["share_prompt_prefix"] else 1)  # prompt + responses
    assert len(calls) == 2 * len(plain_calls)  # every layer forward recomputed once in the backward
    for name in want:
        assert _rel(got[name], want[name]) < 1e-5, name
    for key in ("loss", "entropy", "kl", "grad_norm"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-9), key


@pytest.mark.parametrize("layout", [dict(share_prompt_prefix=True), dict(share_prompt_prefix=False)])
def test_micro_batches_stay_within_the_token_budget_and_train_the_same(layout):
    """A group whose responses would exceed train.micro_batch_tokens is cut into several micro-batches (one
    sample longer than the budget alone); the step is the same as with one micro-batch per group."""
    samples = _groups(seed=2, groups=2, size=4, lengths=(20, 40))
    samples[0] = Sample("long", "0", "0", samples[0].prompt_ids, [7] * 90, [-3.0] * 90, [0] * 90, "stop",
                        advantage=0.5)
    base = dict(lr=1e-3, micro_batch_size=4, off_policy_correction="none", **layout)
    budget = TrainConfig(**base, micro_batch_tokens=64)
    share, chunks = chunk_samples(samples, budget)
    assert len(chunks) > 2 and sorted(id(s) for c in chunks for s in c) == sorted(id(s) for s in samples)
    for chunk in chunks:
        assert computed_tokens(chunk, budget) <= 64 or len(chunk) == 1
    assert any(len(c) == 1 and c[0].sample_id == "long" for c in chunks)
    want, want_metrics, _ = _step_grads(TrainConfig(**base, micro_batch_tokens=10_000), samples)
    got, got_metrics, _ = _step_grads(budget, samples)
    for name in want:
        assert _rel(got[name], want[name]) < 1e-5, name
    assert got_metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5, abs=1e-9)


def test_vllm_kv_cache_is_sized_to_the_run_within_its_cap():
    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    # 64 sequences x 512 tokens in 32-token blocks, + vLLM's null block: 1.41 GiB in fp32, under the 2 GiB cap
    assert kv_cache_blocks_for_run(smollm2, 4, 64, 512, 32, 2.0) == 64 * 16 + 1
    assert kv_cache_blocks_for_run(smollm2, 4, 64, 1024, 32, 2.0) is None  # 2.8 GiB: the cap sizes it
    assert kv_cache_blocks_for_run(smollm2, 2, 64, 1024, 32, 2.0) == 64 * 32 + 1  # bfloat16: half the bytes
