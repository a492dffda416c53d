"""Mixture-of-experts policies and rollout routing replay (R3, issue 20).

A tiny random Mixtral is served by the real reference engine (which records the experts of every
token), and trained by the real GRPO trainer with the routers hooked (rollwise.train.routing_replay).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rollwise.types.train_config import TrainConfig
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.types.generation import GenerationRequest, SamplingParams
from rollwise.model.tiny import tiny_mixtral
from rollwise.train.logprobs import sequence_logprobs
from rollwise.train.routing_replay import RoutingReplay, find_routers, rows_batch
from rollwise.train.trainer import GRPOTrainer, collate
from rollwise.types.routing import RoutedExperts
from rollwise.types.sample import Sample

PROMPTS = [list(range(5, 29)), list(range(40, 59))]


def moe_model(seed: int = 0) -> torch.nn.Module:
    model = tiny_mixtral(seed=seed)
    with torch.no_grad():  # decisive routers: random init is near-uniform, where any rounding flips an expert
        for router in find_routers(model):
            router.weight.mul_(30)
    return model


def rollout(model, prompts=PROMPTS, n: int = 2, prefix_cache_tokens: int = 0, seed: int = 1) -> list[Sample]:
    engine = ReferenceEngine(model, max_num_seqs=8, max_model_len=128, seed=0, prefix_cache_tokens=prefix_cache_tokens)
    requests = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=10, n=n, seed=seed, ignore_eos=True))
                for i, p in enumerate(prompts)]
    samples = [Sample.from_completion(c, problem_id=c.request_id) for c in engine.generate(requests)]
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i % 2 else -1.0
    return samples


def trainer_logprobs(model, samples: list[Sample], mode: str) -> tuple[torch.Tensor, dict]:
    """The trainer's forward (padded rows) over `samples` with the routers hooked in `mode`."""
    batch = collate(samples, torch.ones(sum(len(s.response_ids) for s in samples)), pad_id=0)
    replay = RoutingReplay(model, mode)
    try:
        replay.begin(batch.routing)
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.target_mask)
        replay.end()
        return logp, replay.take_metrics()
    finally:
        replay.remove()


def engine_logprobs(samples: list[Sample]) -> torch.Tensor:
    return torch.tensor([lp for s in samples for lp in s.behaviour_logprobs])


def test_engine_records_routing_of_every_token_compactly():
    samples = rollout(moe_model())
    for s in samples:
        r = s.routed_experts
        assert (r.num_tokens, r.num_layers, r.top_k, r.dtype) == (len(s.prompt_ids) + len(s.response_ids) - 1, 2, 2, "int8")
        assert r.bytes_per_token == 4 and len(r.data) == 4 * r.num_tokens
        assert RoutedExperts.from_wire(r.to_wire()) == r  # base64 on the wire, byte for byte


def test_replay_of_engine_routing_reproduces_engine_logprobs():
    """fp32 engine and trainer: replaying the engine's experts gives the engine's logprobs to 1e-5, and the
    replay is really used: a record with other experts changes the logprobs (and is measured as disagreement)."""
    model = moe_model()
    samples = rollout(model)
    logp, metrics = trainer_logprobs(model, samples, "r3")
    assert torch.allclose(logp, engine_logprobs(samples), atol=1e-5, rtol=0)
    assert metrics["routing_disagreement"] == 0.0

    shifted = [dataclasses.replace(s, routed_experts=RoutedExperts.from_array(
        (s.routed_experts.array() + 1) % 4, num_experts=4)) for s in samples]
    logp_shifted, metrics = trainer_logprobs(model, shifted, "r3")
    assert (logp_shifted - engine_logprobs(samples)).abs().max() > 1e-3
    assert metrics["routing_disagreement"] == 0.0  # the forward used the records...
    # ...which the live router disagrees with (layer 2's live routing follows the replayed layer 1, so it
    # may happen to meet a shifted record)
    assert metrics["routing_disagreement_live"] > 0.9 and metrics["routing_tokens_any_disagree_live"] == 1.0
    logp_observed, metrics = trainer_logprobs(model, shifted, "none")  # observe only: live routing
    assert torch.allclose(logp_observed, engine_logprobs(samples), atol=1e-5, rtol=0)
    assert metrics["routing_disagreement"] == 1.0 and metrics["routing_tokens_any_disagree"] == 1.0


def test_replay_when_engine_routes_differently_matches_engine_not_live():
    """An engine whose routers differ slightly from the trainer's (a stand-in for kernel/precision
    differences): with R3 the trainer uses the engine's experts, so it disagrees nowhere; without it the
    trainer's own routing differs somewhere."""
    model = moe_model()
    engine_model = copy.deepcopy(model)
    with torch.no_grad():
        for router in find_routers(engine_model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)
    samples = rollout(engine_model)
    logp_live, observed = trainer_logprobs(model, samples, "none")
    assert observed["routing_disagreement"] > 0 and observed["routing_tokens_any_disagree"] > 0
    logp_replayed, replayed = trainer_logprobs(model, samples, "r3")
    assert replayed["routing_disagreement"] == 0.0 and replayed["routing_tokens_any_disagree"] == 0.0
    assert replayed["routing_disagreement_live"] > 0  # the live router still differs: it is measured, not used
    assert (logp_replayed - logp_live).abs().max() > 1e-4  # the forward took the engine's experts


@pytest.mark.parametrize("share_prompt_prefix,checkpointing", [(True, False), (False, False), (False, True),
                                                               (True, "selective")])
def test_trainer_replays_and_router_learns(share_prompt_prefix, checkpointing):
    """Through GRPOTrainer.train_step (shared-prompt and padded forwards, activation checkpointing's
    recompute included): no disagreement, engine logprobs reproduced, and the routers get gradients."""
    model = moe_model()
    samples = rollout(model)
    cfg = TrainConfig(lr=1e-3, micro_batch_size=4, routing_replay="r3", share_prompt_prefix=share_prompt_prefix,
                      gradient_checkpointing=checkpointing, grad_clip=1e9)
    trainer = GRPOTrainer(model, cfg, pad_token_id=0)
    router_grads = []
    trainer.before_step = lambda m: router_grads.extend(float(r.weight.grad.abs().sum()) for r in find_routers(m))
    metrics = trainer.train_step(samples)
    assert metrics["routing_disagreement"] == 0.0 and metrics["routing_replayed"] == 1.0
    assert metrics["mismatch_abs_logp"] < 1e-5
    assert len(router_grads) == 2 and all(g > 0 for g in router_grads)
    assert (trainer.routing.recomputed_calls > 0) == bool(checkpointing)  # the recompute reused the replayed experts


def test_prefix_cache_hit_keeps_complete_routing():
    model = moe_model()
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=128, seed=0, prefix_cache_tokens=256)
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=6, seed=1, ignore_eos=True)
    cold = engine.generate([GenerationRequest("a", prompt, params)])[0]
    warm = engine.generate([GenerationRequest("b", prompt + [50, 51], params)])[0]
    assert warm.cached_prompt_tokens >= 32  # the hit skipped the MoE layers of those tokens
    assert warm.routed_experts.num_tokens == len(warm.prompt_ids) + len(warm.token_ids) - 1
    assert (warm.routed_experts.array()[:40] == cold.routed_experts.array()[:40]).all()
    logp, _ = trainer_logprobs(model, [Sample.from_completion(warm, problem_id="p")], "r3")
    assert torch.allclose(logp, torch.tensor(warm.logprobs), atol=1e-5, rtol=0)


def test_bad_records_are_refused_naming_the_sample():
    model = moe_model()
    samples = rollout(model, prompts=PROMPTS[:1], n=1)
    short = dataclasses.replace(samples[0], sample_id="short/0", routed_experts=RoutedExperts.from_array(
        samples[0].routed_experts.array()[:-3], num_experts=4))
    with pytest.raises(ValueError, match=r"sample short/0: routed_experts covers .* expected len\(prompt\)"):
        rows_batch([short], 64)
    missing = dataclasses.replace(samples[0], sample_id="none/0", routed_experts=None)
    with pytest.raises(ValueError, match="sample none/0: no routed_experts"):
        rows_batch([samples[0], missing], 64)
    wrong = dataclasses.replace(samples[0], sample_id="wide/0", routed_experts=RoutedExperts.from_array(
        samples[0].routed_experts.array() + 4, num_experts=8))
    with pytest.raises(ValueError, match=r"sample wide/0: routed_experts names expert ids outside \[0, 4\)"):
        trainer_logprobs(model, [wrong], "r3")
    bare = dataclasses.replace(samples[0], sample_id="bare/0", routed_experts=None)
    trainer = GRPOTrainer(model, TrainConfig(routing_replay="r3"), pad_token_id=0)
    with pytest.raises(ValueError, match="samples bare/0.* carry no routed_experts"):
        trainer.train_step([bare, dataclasses.replace(bare, advantage=1.0)])
    with pytest.raises(ValueError, match="routed_experts: malformed"):
        RoutedExperts.from_wire({"data": "AAAA", "shape": [5, 2, 2], "dtype": "int8"})


def test_r3_on_a_dense_model_is_refused():
    from rollwise.model.tiny import tiny_llama

    with pytest.raises(ValueError, match="routing_replay=r3 needs a mixture-of-experts model"):
        GRPOTrainer(tiny_llama(), TrainConfig(routing_replay="r3"), pad_token_id=0)


def test_routing_survives_engine_server_router_and_agent_proxy_byte_for_byte():
    """One MoE engine behind the real HTTP server, the router in front of it, the agent proxy over the
    router: routing arrives byte for byte on /generate, /v1/completions, through the router, and in the
    proxy's trajectory (every token's routing, the second turn's prefill supplying the template tokens')."""
    import httpx

    from rollwise.agent.generator import HTTPGenerator
    from rollwise.agent.proxy import create_proxy_app
    from rollwise.agent.samples import trajectory_samples
    from rollwise.engine.server import create_app
    from rollwise.local_server import serve_in_thread
    from rollwise.model.tiny import tiny_tokenizer
    from rollwise.router.config import RouterConfig
    from rollwise.router.app import create_app as create_router_app

    model = moe_model()
    tokenizer = tiny_tokenizer()
    engine = ReferenceEngine(model, max_num_seqs=4, max_model_len=512, seed=0, prefix_cache_tokens=1024)
    prompt = tokenizer.encode("route me through the experts")
    params = {"max_tokens": 8, "seed": 5, "ignore_eos": True}
    with serve_in_thread(create_app(engine, tokenizer, "tiny-moe")) as (engine_url, _):
        router_config = RouterConfig(replicas=[engine_url], health_interval_s=0.2, model="tiny-moe")
        with serve_in_thread(create_router_app(router_config)) as (router_url, _):
            direct = httpx.post(f"{engine_url}/generate", json={"prompt_ids": prompt, **params}, timeout=60).json()
            routed = httpx.post(f"{router_url}/generate", json={"prompt_ids": prompt, **params}, timeout=60).json()
            wire = direct["choices"][0]["routed_experts"]
            assert routed["choices"][0]["routed_experts"] == wire
            completion = httpx.post(f"{router_url}/v1/completions", timeout=60, json={
                "model": "tiny-moe", "prompt": prompt, "max_tokens": 8, "seed": 5, "ignore_eos": True}).json()
            assert completion["choices"][0]["routed_experts"] == wire
            experts = RoutedExperts.from_wire(wire)
            assert experts.num_tokens == len(prompt) + 8 - 1
            sample = Sample(sample_id="http/0", group_id="g", problem_id="p", prompt_ids=prompt,
                            response_ids=direct["choices"][0]["token_ids"],
                            behaviour_logprobs=direct["choices"][0]["logprobs"], versions=[0] * 8,
                            finish_reason="length", routed_experts=experts)
            logp, _ = trainer_logprobs(model, [sample], "r3")
            assert torch.allclose(logp, torch.tensor(sample.behaviour_logprobs), atol=1e-5, rtol=0)

            proxy = create_proxy_app(HTTPGenerator(router_url), tokenizer, model_name="tiny-moe")
            with serve_in_thread(proxy) as (proxy_url, _):
                chat = f"{proxy_url}/sessions/s1/v1/chat/completions"
                turn = {"model": "tiny-moe", "max_tokens": 6, "seed": 1}
                first = [{"role": "user", "content": "hi"}]
                r1 = httpx.post(chat, json={**turn, "messages": first}, timeout=60).json()
                second = first + [r1["choices"][0]["message"], {"role": "user", "content": "more"}]
                httpx.post(chat, json={**turn, "messages": second}, timeout=60).raise_for_status()
                traj = httpx.get(f"{proxy_url}/sessions/s1/trajectory", timeout=60).json()
    segment = traj["segments"][0]
    wire_traj = RoutedExperts.from_wire(segment["routed_experts"])
    assert wire_traj.num_tokens == len(segment["token_ids"]) - 1
    from rollwise.agent.trajectory import SampledSpan, Trajectory, TrajectorySegment

    seg = TrajectorySegment(**{**segment, "routed_experts": wire_traj,
                               "spans": [SampledSpan(**s) for s in segment["spans"]]})
    samples = trajectory_samples(Trajectory("s1", [seg], [], traj["turns"], traj["sampled_tokens"]),
                                 problem_id="p", group_id="g", episode_id="e")
    logp, metrics = trainer_logprobs(model, samples, "r3")
    sampled = torch.tensor([lp for lp, m in zip(samples[0].behaviour_logprobs, samples[0].loss_mask) if m])
    assert torch.allclose(logp, sampled, atol=1e-5, rtol=0) and metrics["routing_disagreement"] == 0.0


def test_upcycled_mixtral_keeps_the_dense_model_and_loads_as_a_standard_checkpoint(tmp_path):
    """Sparse upcycling: the MoE's next-token distribution stays the dense model's (perturbed experts,
    near-uniform router); the saved directory is a standard Mixtral checkpoint transformers reloads, and
    the reference engine serves it with HF's logprobs."""
    from transformers import AutoModelForCausalLM

    from rollwise.model.upcycle import upcycle
    from rollwise.model.tiny import tiny_llama

    dense = tiny_llama()
    moe = upcycle(dense, num_experts=4, top_k=2)
    ids = torch.tensor([list(range(5, 45))])
    with torch.no_grad():
        dense_logp = dense(ids).logits.log_softmax(-1)
        moe_logp = moe(ids).logits.log_softmax(-1)
    assert (dense_logp - moe_logp).abs().max() < 0.05
    assert (dense_logp.argmax(-1) == moe_logp.argmax(-1)).all()
    moe.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, moe(ids).logits)
    samples = rollout(reloaded, n=1)
    logp, _ = trainer_logprobs(reloaded, samples, "r3")
    assert torch.allclose(logp, engine_logprobs(samples), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="top_k must be in"):
        upcycle(dense, num_experts=4, top_k=1)


def test_checkpoint_recompute_replays_the_same_experts():
    """Activation checkpointing recomputes each layer in backward: with replay, the recompute must use the
    experts the forward used, so the gradients equal those of a run without checkpointing."""
    engine_model = moe_model()
    with torch.no_grad():  # an engine that routes differently from the trainer: live routing would differ
        for router in find_routers(engine_model):
            router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(3)) * 3)
    samples = rollout(engine_model)
    grads = []
    for checkpointing in (False, True):
        cfg = TrainConfig(lr=1e-3, micro_batch_size=4, routing_replay="r3", share_prompt_prefix=False,
                          gradient_checkpointing=checkpointing, grad_clip=1e9)
        trainer = GRPOTrainer(moe_model(), cfg, pad_token_id=0)
        trainer.before_step = lambda m: grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        trainer.train_step(samples)
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


def test_checkpoint_items_are_the_names_and_tensors_save_pretrained_writes(tmp_path):
    """The per-expert names a weight push gives vLLM are exactly those (and the tensors) of the saved checkpoint."""
    from safetensors.torch import load_file

    from rollwise.model.upcycle import checkpoint_items

    model = moe_model()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    pushed = dict(checkpoint_items(model.state_dict()))
    assert set(pushed) - {"lm_head.weight"} == set(saved)  # tied lm_head: saved once, pushed by both names
    for name, tensor in saved.items():
        assert torch.equal(pushed[name], tensor), name


def test_load_balancing_loss_is_optional_and_reaches_the_router():
    """train.router_aux_loss_coef: off by default (gradients unchanged); on, it adds to the router's gradient."""
    samples = rollout(moe_model())
    grads = []
    for coef in (0.0, 1.0):
        cfg = TrainConfig(lr=1e-3, micro_batch_size=4, routing_replay="r3", share_prompt_prefix=False, grad_clip=1e9,
                          router_aux_loss_coef=coef)
        trainer = GRPOTrainer(moe_model(), cfg, pad_token_id=0)
        trainer.before_step = lambda m: grads.append([r.weight.grad.clone() for r in find_routers(m)])
        trainer.train_step(samples)
    assert TrainConfig().router_aux_loss_coef == 0.0
    assert all((with_aux - without).abs().max() > 1e-6 for without, with_aux in zip(*grads))


def test_upcycle_divergence_knobs_noise_and_drop_upcycling():
    """`noise` scales each expert's perturbation and `drop` (Drop-Upcycling) re-draws exactly that share of
    each expert's intermediate neurons, the same neurons in gate, up and down; the rest stay the dense MLP's.
    Bad values are refused naming the knob."""
    from rollwise.model.upcycle import upcycle
    from rollwise.model.tiny import tiny_llama

    dense = tiny_llama()
    mlp = dense.model.layers[0].mlp
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    inter = mlp.down_proj.weight.shape[1]
    exact = upcycle(dense, noise=0.0).model.layers[0].mlp.experts
    assert all(torch.equal(exact.gate_up_proj[e], gate_up) for e in range(4))
    noisy = upcycle(dense, noise=0.3).model.layers[0].mlp.experts
    spread = ((noisy.gate_up_proj[0] / gate_up - 1)).std()
    assert 0.25 < spread < 0.35
    dropped = upcycle(dense, noise=0.0, drop=0.5).model.layers[0].mlp.experts
    redrawn = []
    for e in range(4):
        kept_rows = (dropped.gate_up_proj[e] == gate_up).all(dim=1)
        kept = kept_rows[:inter] & kept_rows[inter:] & (dropped.down_proj[e] == mlp.down_proj.weight).all(dim=0)
        assert int(kept.sum()) == inter - round(0.5 * inter)
        assert torch.equal(kept_rows[:inter], kept) and torch.equal(kept_rows[inter:], kept)
        redrawn.append(~kept)
    assert not all(torch.equal(redrawn[0], r) for r in redrawn[1:])  # each expert re-draws its own neurons
    with pytest.raises(ValueError, match="drop must be in"):
        upcycle(dense, drop=1.5)
    with pytest.raises(ValueError, match="noise must be >= 0"):
        upcycle(dense, noise=-0.1)
