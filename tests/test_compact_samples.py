"""Compact sample storage (issue 26): a sample's ids, log-probs and versions stay exact through the
compact arrays into the trainer's tensors, and a rollout keeps them compact (the simulator at 4096
GPUs holds ~800k waiting samples)."""

from __future__ import annotations

from array import array

import pytest
import torch

from rollwise.types.generation import Completion
from rollwise.sim.run import build
from rollwise.sim.scenario import Scenario
from rollwise.train.packing import collate_packed_groups
from rollwise.train.trainer import collate
from rollwise.types.compact import LogprobRuns, TokenRuns, VersionRuns
from rollwise.types.sample import Sample


def _engine_output(seed: int, n: int, vocab: int = 151_936) -> tuple[list[int], list[float]]:
    """Ids across a large vocabulary and log-probs exactly as an engine returns them (float32 -> float)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g).tolist()
    ids[0], ids[-1] = vocab - 1, 0
    logits = torch.randn(n, 64, generator=g, dtype=torch.float32)
    logprobs = torch.log_softmax(logits, -1)[:, 0].tolist()
    return ids, logprobs


def _samples() -> list[Sample]:
    prompt = [5, 151_000, 7]
    out = []
    for i, n in enumerate([9, 4, 13]):
        ids, logprobs = _engine_output(i, n)
        c = Completion("g0", i, prompt, ids, logprobs, [3] * (n // 2) + [4] * (n - n // 2), "length")
        out.append(Sample.from_completion(c, problem_id="p", sample_id=f"g0/{i}", group_id="g0"))
    return out


def test_ids_logprobs_and_versions_round_trip_exactly_into_the_trainer_tensors():
    samples = _samples()
    wanted = [_engine_output(i, n) for i, n in enumerate([9, 4, 13])]
    for s, (ids, logprobs) in zip(samples, wanted):
        assert isinstance(s.response_ids, array) and s.response_ids.itemsize == 4
        assert isinstance(s.behaviour_logprobs, array) and s.behaviour_logprobs.typecode == "f"
        assert list(s.response_ids) == ids and list(s.behaviour_logprobs) == logprobs  # bit-exact
        assert s.versions == [3] * (len(ids) // 2) + [4] * (len(ids) - len(ids) // 2)
        assert list(s.versions.runs()) == [(3, len(ids) // 2), (4, len(ids) - len(ids) // 2)]
    weights = torch.ones(sum(len(s.response_ids) for s in samples))
    flat_logprobs = torch.tensor([lp for _, lps in wanted for lp in lps], dtype=torch.float32)

    mb = collate(samples, weights, pad_id=0)
    assert torch.equal(mb.behaviour_logp, flat_logprobs)
    for row, (s, (ids, _)) in enumerate(zip(samples, wanted)):
        assert mb.input_ids[row, : 3 + len(ids)].tolist() == [5, 151_000, 7] + ids
    packed = collate_packed_groups(samples, weights, pad_id=0)
    assert torch.equal(packed.behaviour_logp, flat_logprobs)
    assert packed.prompts[0, :3].tolist() == [5, 151_000, 7]
    assert packed.tokens.flatten()[packed.order].tolist() == [t for ids, _ in wanted for t in ids]


def test_version_runs_read_like_a_list():
    versions = [0, 0, 1, 1, 1, 2]
    runs = VersionRuns(versions)
    assert runs == versions and list(runs) == versions and len(runs) == 6
    assert [runs[i] for i in range(-6, 6)] == versions + versions
    assert runs[1:4] == versions[1:4] and runs.count(1) == 3 and min(runs) == 0 and runs.lowest(9) == 0
    assert VersionRuns.from_runs([(0, 2), (1, 1), (1, 2), (2, 0), (2, 1)]) == runs
    assert VersionRuns([]).lowest(7) == 7 and VersionRuns([]) == []
    with pytest.raises(IndexError):
        runs[6]


def test_bad_per_token_values_name_the_field():
    with pytest.raises(ValueError, match="sample x: response_ids"):
        Sample("x", "g", "p", [1], [2**40], [0.0], [0], "stop")
    with pytest.raises(ValueError, match="sample x: behaviour_logprobs"):
        Sample("x", "g", "p", [1], [2], ["-0.5"], [0], "stop")
    with pytest.raises(ValueError, match="versions must be integers"):
        Sample("x", "g", "p", [1], [2], [-0.5], [0.5], "stop")


def test_a_rollout_keeps_its_waiting_samples_compact_and_shares_the_group_prompt():
    s = Scenario.model_validate({
        "name": "t", "seed": 1,
        "cluster": {"gpus": 2, "cost": "h100-7b", "max_num_seqs": 16, "trainer_gpus": 1},
        "workload": {"updates": 1, "prompts_per_step": 2, "group_size": 4, "prompt_tokens": 32,
                     "output": {"median": 50, "sigma": 0.5, "max_tokens": 256}},
        "rollout": {"mode": "sorted", "max_staleness": 1},
    })
    controller = build(s).controller
    batch = controller.next_batch()
    assert len(batch) == 8
    by_group: dict[str, list[Sample]] = {}
    for sample in batch:
        by_group.setdefault(sample.group_id, []).append(sample)
        n = len(sample.response_ids)
        assert isinstance(sample.versions, VersionRuns) and sample.versions == [0] * n
        # the simulator's synthetic tokens stay runs (one token, EOS last on a stop), not per-token arrays
        assert isinstance(sample.response_ids, TokenRuns) and len(list(sample.response_ids.runs())) <= 2
        assert isinstance(sample.behaviour_logprobs, LogprobRuns) and sample.behaviour_logprobs == [-1.0] * n
        assert (sample.response_ids[-1] == 2) == (sample.finish_reason == "stop")
    for members in by_group.values():  # one prompt array a group, not one a sample
        assert len({id(m.prompt_ids) for m in members}) == 1 and len(members[0].prompt_ids) == 32
    controller.close()
