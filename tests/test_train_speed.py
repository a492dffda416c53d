"""The faster train step computes what the plain one does (issue 23 item 2): the fused LM-head
log-probs (train.fused_logprobs), fused AdamW (train.fused_optimizer) and packed responses
(train.pack_responses) against the checkpointed log_softmax path, AdamW's per-parameter loop and
one padded row per response, to a max relative error of 1e-5 in fp32, on a tiny
model with unequal prompt/response lengths and zero-advantage groups. Exactness, not timing
(`rollwise bench trainer-step` times them)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from rollwise.types.train_config import TrainConfig
from rollwise.model.tiny import tiny_llama
from rollwise.train.logprobs import FusedLogprobs, LogprobOptions, lm_head_logprobs
from rollwise.types.microbatch import pack_responses
from rollwise.train.distributed import RankSpec, free_port, init_rank
from rollwise.train.rank import RankTrainer
from rollwise.train.sharded import split_work
from rollwise.train.trainer import GRPOTrainer
from rollwise.train.packing import collate_group
from rollwise.types.sample import Sample
from random_groups import random_groups

MAX_REL = 1e-5


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _samples(seed: int, groups: int = 4, group_size: int = 3, zero_groups: int = 1) -> list[Sample]:
    """The first `zero_groups` groups have advantage 0 (skipped without a KL term, trained with one)."""
    return random_groups(seed, "advantage", groups, group_size, zero_groups=zero_groups, random_behaviour=True)


@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, True)])
@pytest.mark.parametrize("keep_mib", [512.0, 0.0])  # softmax kept for the backward, or recomputed per chunk
def test_fused_logprobs_equal_the_checkpointed_log_softmax(temperature, bias, keep_mib):
    torch.manual_seed(0)
    lm_head = torch.nn.Linear(24, 97, bias=bias)
    hidden = torch.randn(23, 24, requires_grad=True)
    targets = torch.randint(0, 97, (23,))
    upstream = torch.randn(23)  # any loss: its gradient w.r.t. the log-probs

    def run(fused: bool):
        lm_head.zero_grad()
        hidden.grad = None
        if fused:
            logp, entropy = FusedLogprobs.apply(hidden, lm_head.weight, lm_head.bias, targets, temperature, 5,
                                                keep_mib)
        else:
            logp, entropy = lm_head_logprobs(hidden, lm_head, targets, LogprobOptions(temperature, chunk_tokens=5))
        (logp * upstream).sum().backward()
        grads = [hidden.grad.clone(), lm_head.weight.grad.clone()] + ([lm_head.bias.grad.clone()] if bias else [])
        return [logp.detach(), entropy.detach()] + grads

    for got, want in zip(run(True), run(False)):
        assert _rel(got, want) <= MAX_REL


def test_fused_logprobs_without_a_graph_equal_the_plain_path():
    """The reference model and the measuring forward run without grad: same log-probs and entropy."""
    model = tiny_llama(seed=7)
    hidden = torch.randn(9, 64)
    targets = torch.randint(0, model.config.vocab_size, (9,))
    with torch.no_grad():
        fused = lm_head_logprobs(hidden, model.get_output_embeddings(), targets, LogprobOptions(0.8, fused=True))
        plain = lm_head_logprobs(hidden, model.get_output_embeddings(), targets, LogprobOptions(0.8))
    for got, want in zip(fused, plain):
        assert _rel(got, want) <= MAX_REL


def _step(cfg: TrainConfig, samples: list[Sample]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                            dict[str, float]]:
    """(gradients before clipping, each weight's update, metrics) of one train step."""
    model = tiny_llama(seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, cfg, pad_token_id=0)
    grads: dict[str, torch.Tensor] = {}
    trainer.before_step = lambda m: grads.update({n: p.grad.clone() for n, p in m.named_parameters()})
    metrics = trainer.train_step(samples)
    return grads, {n: p.detach() - before[n] for n, p in model.named_parameters()}, metrics


CASES = [(True, 0.0, "token_mean"), (False, 0.0, "seq_mean_token_mean"),
         (True, 0.05, "token_mean")]  # with a KL term the zero-advantage group is trained; the reference runs fused


@pytest.mark.parametrize("share,kl_coef,loss_agg", CASES)
def test_fused_logprobs_train_step_equals_the_plain_step(share, kl_coef, loss_agg):
    """Same gradients and metrics (the optimizer is the same on both sides)."""
    samples = _samples(seed=1)
    base = dict(lr=1e-3, micro_batch_size=2, off_policy_correction="none", share_prompt_prefix=share,
                kl_coef=kl_coef, loss_agg=loss_agg, fused_optimizer=False)
    want_grads, _, want_metrics = _step(TrainConfig(**base, fused_logprobs=False), samples)
    got_grads, _, got_metrics = _step(TrainConfig(**base, fused_logprobs=True), samples)
    assert want_grads.keys() == got_grads.keys()
    for name in want_grads:
        assert _rel(got_grads[name], want_grads[name]) <= MAX_REL, name
    assert got_metrics["trained_tokens"] == want_metrics["trained_tokens"] > 0
    for key in ("loss", "grad_norm", "entropy", "mismatch_abs_logp", "kl", "clip_fraction"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=MAX_REL, abs=1e-9), key


def test_fused_optimizer_makes_the_same_update():
    """Identical gradients (same log-prob path) give the same AdamW update with the fused kernel,
    weight decay and gradient clipping included."""
    samples = _samples(seed=2)
    base = dict(lr=1e-3, micro_batch_size=2, off_policy_correction="none", weight_decay=0.1, grad_clip=0.05)
    _, want, _ = _step(TrainConfig(**base, fused_optimizer=False), samples)
    _, got, metrics = _step(TrainConfig(**base, fused_optimizer=True), samples)
    assert metrics["grad_norm"] > 0.05  # the clip is active
    for name in want:
        assert want[name].abs().max() > 0, name
        assert _rel(got[name], want[name]) <= MAX_REL, name


def test_pack_responses_fills_rows_first_fit_decreasing():
    rows, width = pack_responses([3, 12, 5, 7, 9, 2, 1])
    assert width == 12
    assert rows == [[1], [4, 0], [3, 2], [5, 6]]  # 12 | 9+3 | 7+5 | 2+1: four rows instead of seven


def test_packed_group_computes_fewer_positions():
    samples = [s for s in _samples(seed=3, groups=1, group_size=8, zero_groups=0)]
    n = sum(len(s.response_ids) for s in samples)
    padded = collate_group(samples, torch.ones(n), pad_id=0)
    packed = collate_group(samples, torch.ones(n), pad_id=0, pack=True)
    assert packed.responses.numel() < padded.responses.numel()
    assert packed.n_tokens == padded.n_tokens == n


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_packed_train_step_equals_the_padded_step(kl_coef):
    """Several responses per row (block-diagonal causal mask, positions per response) give the
    padded shared-prompt step's gradients and metrics."""
    samples = _samples(seed=4, groups=3, group_size=5)
    base = dict(lr=1e-3, micro_batch_size=5, off_policy_correction="none", kl_coef=kl_coef)
    want_grads, _, want_metrics = _step(TrainConfig(**base, pack_responses=False), samples)
    got_grads, _, got_metrics = _step(TrainConfig(**base, pack_responses=True), samples)
    for name in want_grads:
        assert _rel(got_grads[name], want_grads[name]) <= MAX_REL, name
    for key in ("loss", "grad_norm", "entropy", "mismatch_abs_logp", "kl", "trained_tokens"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=MAX_REL, abs=1e-9), key


def _rank_gradients(rank: int, port: int, cfg: TrainConfig, samples: list[Sample], out: dict) -> None:
    spec = RankSpec(rank, 2, port, "cpu", threads=1)
    trainer = RankTrainer(tiny_llama(seed=3), cfg, spec, init_rank(spec), pad_token_id=0, temperature=1.0)

    def gather(model):  # every rank all-gathers its gradient shards; rank 0 reports them
        full = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        if rank == 0:
            out.update(full)
    trainer.before_step = gather
    informative = [s for s in samples if s.advantage != 0.0]  # as ShardedTrainer.train_step deals them
    trainer.train(split_work(informative, cfg, 2)[rank])
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks need 2 CPU cores")
def test_two_ranks_with_every_switch_compute_the_plain_single_process_gradient():
    """FSDP2 ranks (rollwise.train.rank) with fused log-probs and packed responses: the gradient of
    one process running the plain padded, unfused step."""
    samples = _samples(seed=5, groups=4, group_size=3)
    base = dict(lr=1e-3, micro_batch_size=3, off_policy_correction="none")
    want, _, _ = _step(TrainConfig(**base, fused_logprobs=False, fused_optimizer=False, pack_responses=False),
                       samples)
    cfg = TrainConfig(**base, fused_logprobs=True, fused_optimizer=True, pack_responses=True)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_gradients, args=(free_port(), cfg, samples, out), nprocs=2)
        got = dict(out)
    assert got.keys() == want.keys()
    for name in want:
        assert _rel(got[name], want[name]) <= MAX_REL, name


def test_bench_trainer_step_runs_interleaved_arms_and_refuses_unknown_ones():
    from rollwise.bench.trainer import run_trainer_step_bench
    from rollwise.model.tiny import tiny_tokenizer

    model, tokenizer = tiny_llama(seed=0), tiny_tokenizer()
    result = run_trainer_step_bench(model, tokenizer, model_spec="tiny:0", quick=True, rounds=2,
                                    arms=["baseline", "pack_responses"])
    rows = {row["arm"]: row for row in result["rows"]}
    assert rows["baseline"]["median_ratio_to_baseline"] == 1.0
    assert len(rows["pack_responses"]["step_s"]) == 2 and rows["pack_responses"]["mfu"] > 0
    assert result["batch"]["trained_samples"] < result["batch"]["samples"]  # a zero-advantage group is skipped
    with pytest.raises(ValueError, match="arms must include 'baseline'"):
        run_trainer_step_bench(model, tokenizer, model_spec="tiny:0", quick=True, arms=["fused"])


def test_bench_loop_takes_overrides_for_a_before_row():
    from rollwise.bench.loop import loop_overrides
    from rollwise.config import load_config

    before = ["train.fused_logprobs=false", "train.fused_optimizer=false", "train.pack_responses=false"]
    cfg = load_config(None, loop_overrides(False, None, "runs/x", before))
    assert not (cfg.train.fused_logprobs or cfg.train.fused_optimizer or cfg.train.pack_responses)
    assert load_config(None, loop_overrides(False, None, "runs/x")).train.pack_responses


# ---------------------------------------------------------------- several groups per forward (train.pack_groups)

@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_several_groups_in_one_forward_equal_one_group_per_forward(kl_coef):
    """train.pack_groups: groups of unequal prompt lengths in one micro-batch (prompts batched and
    right-padded, each row over its own prompt's KV) give the one-group packed step's gradients,
    log-probs and metrics; a zero-advantage group included (trained with the KL term)."""
    from rollwise.types.microbatch import chunk_samples

    samples = _samples(seed=6, groups=4, group_size=3)
    assert len({len(s.prompt_ids) for s in samples}) > 1
    base = dict(lr=1e-3, micro_batch_size=3, off_policy_correction="none", kl_coef=kl_coef, pack_responses=True)
    before, after = TrainConfig(**base, pack_groups=False), TrainConfig(**base, pack_groups=True)
    assert len(chunk_samples(samples, after)[1]) < len(chunk_samples(samples, before)[1])
    want_grads, _, want_metrics = _step(before, samples)
    got_grads, _, got_metrics = _step(after, samples)
    for name in want_grads:
        assert _rel(got_grads[name], want_grads[name]) <= MAX_REL, name
    for key in ("loss", "grad_norm", "entropy", "mismatch_abs_logp", "kl", "trained_tokens"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=MAX_REL, abs=1e-9), key


def test_packed_groups_logprobs_equal_each_group_alone():
    """Per-token log-probs and their gradient into the model, micro-batch against micro-batch."""
    from rollwise.train.packing import collate_packed_groups

    samples = _samples(seed=7, groups=3, group_size=4)
    model = tiny_llama(seed=3)
    upstream = torch.randn(sum(len(s.response_ids) for s in samples), generator=torch.Generator().manual_seed(0))

    def run(batches):
        model.zero_grad()
        logp = torch.cat([mb.logprobs(model, LogprobOptions(0.9, 7, fused=True))[0] for mb in batches])
        (logp * upstream).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_logp, want_grads = run([collate_group(samples[g * 4 : g * 4 + 4], torch.ones(1), 0, pack=True)
                                 for g in range(3)])
    got_logp, got_grads = run([collate_packed_groups(samples, torch.ones(1), 0)])
    assert _rel(got_logp, want_logp) <= MAX_REL
    for name in want_grads:
        assert _rel(got_grads[name], want_grads[name]) <= MAX_REL, name


def test_pack_groups_chunks_whole_groups_within_the_token_budget_and_counts_what_it_computes():
    from rollwise.types.microbatch import chunk_samples, computed_tokens

    def group(g: int, prompt: int, lengths: list[int]) -> list[Sample]:
        return [Sample(f"{g}/{i}", f"g{g}", "p", [100 + g] * prompt, [5] * n, [0.0] * n, [0] * n, "stop",
                       advantage=1.0) for i, n in enumerate(lengths)]

    a, b, c = group(0, 10, [4, 4, 4, 4]), group(1, 6, [1, 1, 1, 8]), group(2, 10, [8, 8])
    cfg = TrainConfig(micro_batch_size=4, pack_groups=True, micro_batch_tokens=60)
    _, chunks = chunk_samples(a + b + c, cfg)
    # longest responses first: b + c fit in 60 positions (2 prompts padded to 10, b packs 8 | 1+1+1,
    # c 8 | 8: 4 rows 8 wide = 52), a joining them would make 78
    assert [[s.group_id for s in ch] for ch in chunks] == [["g1"] * 4 + ["g2"] * 2, ["g0"] * 4]
    assert computed_tokens(a + b + c, cfg) == (2 * 10 + 4 * 8) + (10 + 4 * 4)
    # a + b: rows 8 wide: a packs 4+4 | 4+4, b 8 | 1+1+1 -> 4 rows
    assert computed_tokens(a + b, cfg) == 2 * 10 + 4 * 8
    # one packed group: its prompt + rows x its longest (not group size x its longest, as before)
    assert computed_tokens(b, cfg) == 6 + 2 * 8
    assert computed_tokens(b, cfg.model_copy(update={"pack_responses": False})) == 6 + 4 * 8
    # a group over micro_batch_size samples is cut in pieces, which may go back together within the budget
    assert [len(ch) for ch in chunk_samples(group(3, 2, [1] * 9), cfg)[1]] == [9]
    assert [len(ch) for ch in chunk_samples(group(3, 2, [1] * 9), cfg.model_copy(
        update={"pack_groups": False}))[1]] == [4, 4, 1]
