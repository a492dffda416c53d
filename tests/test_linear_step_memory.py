"""A train step's memory linear in response length (issue 41 item 7): an unpadded row (one response filling it,
after its whole prompt) runs as one causal sequence with no attention mask, so SDPA takes its is_causal kernel
and nothing of [length x length] is built; values and gradients equal the masked continuation over the
prompt's KV cache."""

from __future__ import annotations

import random
from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode  # torch's own (private) dispatch-mode base
from torch.utils._pytree import tree_leaves

from rollwise.model.tiny import tiny_llama
from rollwise.train.logprobs import backbone_of
from rollwise.train.packing import shared_prefix_hidden, unmasked_rows
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _forward_grads(model, masked: bool, prompts, prompt_lens, tokens, row_group, segment_start):
    """(prompt hidden, row hidden, parameter gradients of a random projection of both); `masked` forces the
    masked continuation over the prompt KV (a prompt scope always takes it)."""
    model.zero_grad()
    scope = nullcontext() if masked else None
    prompt_hidden, row_hidden, _ = shared_prefix_hidden(backbone_of(model), prompts, prompt_lens, tokens,
                                                        row_group, segment_start, prompt_scope=scope)
    gen = torch.Generator().manual_seed(3)
    loss = ((prompt_hidden * torch.randn(prompt_hidden.shape, generator=gen)).sum()
            + (row_hidden * torch.randn(row_hidden.shape, generator=gen)).sum())
    loss.backward()
    return prompt_hidden.detach(), row_hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_unmasked_rows_equal_the_masked_shared_prefix_forward():
    model = tiny_llama(seed=4)
    model.train()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 90, (2, 5), generator=gen)
    tokens = torch.randint(3, 90, (3, 40), generator=gen)
    layout = (prompts, torch.tensor([5, 5]), tokens, torch.tensor([0, 0, 1]), torch.zeros(3, 40, dtype=torch.long))
    assert unmasked_rows(layout[0], layout[1], layout[3], layout[4])
    got, want = _forward_grads(model, False, *layout), _forward_grads(model, True, *layout)
    for a, b in zip(got[:2], want[:2]):
        assert _rel(a, b) < 1e-5
    for name in want[2]:  # float round-off (other kernels, sums in another order)
        assert _rel(got[2][name], want[2][name]) < 1e-5, name
    # packed (two responses in a row), a padded prompt, or prompt recomputation beyond 1/8: the masked path
    assert not unmasked_rows(prompts, torch.tensor([5, 4]), layout[3], layout[4])
    assert not unmasked_rows(prompts, layout[1], layout[3], torch.tensor([[0] * 20 + [20] * 20] * 3))
    assert not unmasked_rows(prompts, layout[1], torch.tensor([0] * 9 + [1]), torch.zeros(10, 4, dtype=torch.long))


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


@pytest.mark.parametrize("pack_responses", [True, False])  # packed rows (shared_prefix_hidden) / padded rows
def test_a_long_response_step_builds_no_length_squared_tensor(pack_responses):
    length, prompt_len = 1024, 16
    model = tiny_llama(seed=2, max_position_embeddings=2048)
    cfg = TrainConfig(lr=1e-4, off_policy_correction="none", gradient_checkpointing=True,
                      pack_responses=pack_responses)
    trainer = GRPOTrainer(model, cfg, pad_token_id=0)
    rng = random.Random(0)
    sample = Sample(sample_id="0/0", group_id="0", problem_id="0", prompt_ids=[rng.randrange(3, 90) for _ in
                    range(prompt_len)], response_ids=[rng.randrange(3, 90) for _ in range(length)],
                    behaviour_logprobs=[-4.0] * length, versions=[0] * length, finish_reason="length",
                    advantage=1.0)
    largest = _LargestTensor()
    with largest:
        metrics = trainer.train_step([sample])
    assert metrics["trained_tokens"] == length
    # the masked forward built [1, 1, L, P + L] masks (and SDPA a float copy per layer); now the largest tensor
    # is a [L, hidden or vocab] one
    assert largest.numel < length * length // 4, largest.numel
