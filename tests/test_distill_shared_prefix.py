"""The teacher's packed scoring computes a group's shared prompt once (rollwise.engine.reference.scoring
.shared_prefix_forward): its log-probs equal each sequence scored alone (no sharing) and the model's own forward to
fp32 round-off, and the prompt's tokens are computed once. Tiny random model."""

from __future__ import annotations

import pytest
import torch

from rollwise.control.teacher import Teacher
from rollwise.engine.reference.scoring import shared_prefix_forward
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.types.sample import Sample
from rollwise.types.score import ScoreSequence
from rollwise.types.sft_config import TeacherConfig

pytestmark = pytest.mark.usefixtures("single_torch_thread")
PROMPT_A = [3, 17, 29, 4, 88]
PROMPT_B = [9, 2, 30, 41, 52, 63, 70, 71]
# two groups of different prompt lengths (responses of several lengths, two equal ones), a lone sequence, and a
# sequence that starts with PROMPT_A but scores from elsewhere (another prefix: not shared with group A)
BATCH = [ScoreSequence(token_ids=PROMPT_A + r, start=len(PROMPT_A)) for r in ([100, 7, 7, 61], [5], [15, 2, 99],
                                                                              [15, 2, 99], [8] * 11)]
BATCH += [ScoreSequence(token_ids=PROMPT_B + r, start=len(PROMPT_B)) for r in ([1, 2], [33, 44, 55, 66, 77])]
BATCH += [ScoreSequence(token_ids=[5, 6, 7, 8], start=1), ScoreSequence(token_ids=PROMPT_A + [1, 2], start=3)]


@pytest.fixture(scope="module")
def teacher():
    teacher = Teacher.start(TeacherConfig(model="tiny:1"), tiny_tokenizer(), temperature=0.7, max_model_len=64)
    yield teacher
    teacher.close()


def test_shared_prompt_computed_once():
    forward = shared_prefix_forward(BATCH)
    unshared = sum(len(s.token_ids) for s in BATCH)
    assert len(forward.token_ids) == unshared - 4 * len(PROMPT_A) - len(PROMPT_B)
    assert forward.keys is not None and len(forward.targets) == sum(len(s.token_ids) - s.start for s in BATCH)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefix_scores_equal_unshared(teacher, temperature):
    """One call (prompts shared) equals each sequence alone (nothing to share) and the model's forward, to 1e-5."""
    model = tiny_llama(seed=1)
    with torch.no_grad():
        expected = [torch.log_softmax(model(input_ids=torch.tensor([s.token_ids])).logits[0, s.start - 1:-1].float()
                                      / temperature, -1).gather(-1, torch.tensor(s.token_ids[s.start:])[:, None])[:, 0]
                    for s in BATCH]
    shared = teacher.scorer.score_tokens(BATCH, temperature)
    alone = [teacher.scorer.score_tokens([s], temperature)[0] for s in BATCH]
    for got, one, want in zip(shared, alone, expected):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(one), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5)


def test_teacher_token_logprobs_of_a_group(teacher):
    """The teacher's per-sample log-probs of a GRPO group (one prompt) equal the samples scored one by one."""
    samples = [Sample(sample_id=f"g/{i}", group_id="g", problem_id="p", prompt_ids=PROMPT_A, response_ids=r,
                      behaviour_logprobs=[-1.0] * len(r), versions=[0] * len(r), finish_reason="stop")
               for i, r in enumerate(([100, 7, 7, 61], [5, 9], [15, 2, 99]))]
    together = teacher.token_logprobs(samples)
    for s, got in zip(samples, together):
        torch.testing.assert_close(got, teacher.token_logprobs([s])[0], atol=1e-5, rtol=1e-5)


def test_prefix_batches_keep_a_group_together_within_the_bounds():
    """prefix_batches: every sequence once, no batch over its bounds, a group that fits in one batch."""
    from rollwise.engine.scoring import prefix_batches

    groups = [[ScoreSequence(token_ids=[g + 1] * 4 + [7] * n, start=4) for n in (3, 9, 5, 12)] for g in range(6)]
    sequences = [s for k in range(4) for g in groups for s in g[k : k + 1]]  # interleaved, as lengths would sort them
    batches = prefix_batches(sequences, max_tokens=40, max_sequences=6)
    assert sorted(i for b in batches for i in b) == list(range(len(sequences)))
    assert all(sum(len(sequences[i].token_ids) for i in b) <= 40 and len(b) <= 6 for b in batches)
    for g in range(1, 7):  # each group (4 sequences, 45 tokens) in two batches, not scattered over all of them
        assert sum(any(sequences[i].token_ids[0] == g for i in b) for b in batches) == 2
