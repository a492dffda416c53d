"""Prefix sharing in the Tinker service's forward_backward (rollwise.service.prefix_share): datums of one model
that start with the same tokens compute that prefix once. Logprobs, loss and gradients equal each datum computed
alone (no sharing possible), for LoRA and full-parameter tenants, with datums that share nothing, a datum that is
a prefix of the others, a one-token datum, a datum weighted zero on its prompt; and two LoRA tenants sending the
same tokens in one pass share nothing across tenants."""

from __future__ import annotations

import pytest
import torch
from tinker import types

from rollwise.service.base_models import BaseModels
from rollwise.service.datums import Datum, ForwardBackwardBatch
from rollwise.service.prefix_share import head_inputs, plan_prefixes
from rollwise.service.tenant_model import TenantModel, forward_backward_many

pytestmark = pytest.mark.usefixtures("single_torch_thread")

LORA = types.LoraConfig(rank=4, seed=7)  # attention, MLP and lm_head adapters


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return BaseModels(tmp_path_factory.mktemp("data")).get("tiny:0")


def datum(tokens: torch.Tensor, g: torch.Generator, zero_before: int = 0) -> Datum:
    targets = torch.cat([tokens[1:], torch.randint(3, 100, (1,), generator=g)])
    weights = torch.rand(tokens.numel(), generator=g)
    weights[:zero_before] = 0.0
    return Datum(tokens=tokens, inputs={"target_tokens": targets, "weights": weights})


def grpo_like(seed: int) -> list[Datum]:
    """Two groups of three continuations of one prompt each, a datum that is its group's prompt alone, one that
    shares nothing, a one-token datum, interleaved (the planner sorts them)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (9,), generator=g), torch.randint(3, 100, (6,), generator=g)]
    data = []
    for k in range(3):
        for p, prompt in enumerate(prompts):
            cont = torch.randint(3, 100, (2 + 2 * k + p,), generator=g)
            data.append(datum(torch.cat([prompt, cont]), g, zero_before=prompt.numel() if k == 1 else 0))
    data.append(datum(prompts[0].clone(), g))
    data.append(datum(torch.randint(3, 100, (5,), generator=g), g))
    data.append(datum(torch.randint(3, 100, (1,), generator=g), g))
    return data


def fb(data: list[Datum], loss_fn: str = "cross_entropy") -> ForwardBackwardBatch:
    return ForwardBackwardBatch(model_id="m", seq_id=1, loss_fn=loss_fn, loss_config={}, forward_only=False, data=data)


def tenant(base, lora: types.LoraConfig | None) -> TenantModel:
    t = TenantModel(base, lora)
    if lora is not None:  # B starts at 0: draw every adapter tensor so that the adapter changes activations
        g = torch.Generator().manual_seed(lora.seed or 0)
        t.adapter.load({k: 0.05 * torch.randn(v.shape, generator=g) for k, v in t.adapter.state().items()})
    return t


def params(t: TenantModel) -> list[torch.nn.Parameter]:
    return t.adapter.parameters() if t.is_lora else list(t.model.parameters())


def alone(t: TenantModel, data: list[Datum]) -> tuple[list[torch.Tensor], float]:
    """Each datum in a batch of its own (nothing to share); gradients accumulate over the calls."""
    logprobs, loss = [], 0.0
    for d in data:
        (lp,), metrics = t.forward_backward(fb([d]))
        logprobs.append(lp)
        loss += metrics["loss:sum"]
    return logprobs, loss


def assert_same(shared: TenantModel, single: TenantModel, got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    for p, q in zip(params(shared), params(single), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4)


def test_planner_groups_datums_by_their_shared_prompt():
    data = grpo_like(0)
    layout = plan_prefixes([d.tokens for d in data], [0] * len(data))
    assert layout is not None
    by_group = {tuple(sorted(members)): n for members, n in zip(layout.groups, layout.prefix_lens)}
    assert by_group[(0, 2, 4, 6)] == 8  # the prompt alone (9 tokens) keeps one token to continue
    assert by_group[(1, 3, 5)] == 6
    # the LM head computes a prefix position once per group where the members' targets agree (group 0: all 8;
    # group 1: 5 of 6, the last one's target is each continuation's first token), every other position per datum
    hidden = [torch.zeros(d.tokens.numel(), 1) for d in data]
    _, row_targets, _ = head_inputs(hidden, [d.inputs["target_tokens"] for d in data], layout.prefix_of_rows(len(data)))
    assert row_targets.numel() == sum(d.tokens.numel() for d in data) - 3 * 8 - 2 * 5
    # nothing shared (different models, or no common first token): the padded forward
    assert plan_prefixes([d.tokens for d in data[:2]], [0, 1]) is None
    assert plan_prefixes([torch.tensor([5, 6, 7]), torch.tensor([6, 6, 7])], [0, 0]) is None


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_shared_prefix_equals_each_datum_alone(base, lora):
    data = grpo_like(1)
    shared, single = tenant(base, lora), tenant(base, lora)
    (got, metrics), = forward_backward_many([(shared, fb(data))])
    want, loss = alone(single, data)
    assert metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
    assert_same(shared, single, got, want)


def test_tenants_sending_the_same_tokens_share_nothing_across_adapters(base):
    data = grpo_like(2)
    other = types.LoraConfig(rank=4, seed=8)
    a, b = tenant(base, LORA), tenant(base, other)
    (got_a, _), (got_b, _) = forward_backward_many([(a, fb(data)), (b, fb(data))])
    a1, b1 = tenant(base, LORA), tenant(base, other)
    want_a, _ = alone(a1, data)
    want_b, _ = alone(b1, data)
    assert not torch.allclose(got_a[0], got_b[0])  # the adapters differ: so must the prefix's activations
    assert_same(a, a1, got_a, want_a)
    assert_same(b, b1, got_b, want_b)
