"""Tenant models of the Tinker service (rollwise.service.tenant_model) on a tiny random Llama: target logprobs
against an independent computation (a merged-weight copy of the model), LoRA tenants batched over one base
equal to each alone (logprobs, gradients, weights after optim_step), gradient accumulation, AdamW, bit-exact
save/load, sampler snapshots, and refusals that change nothing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tinker import types

from rollwise.engine.reference.lora import AdapterSet, projection_targets
from rollwise.service.base_models import BaseModels
from rollwise.service.datums import Datum, ForwardBackwardBatch
from rollwise.service.errors import ServiceUserError
from rollwise.service.tenant_model import TenantModel, forward_backward_many

pytestmark = pytest.mark.usefixtures("single_torch_thread")

ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
LORAS = {  # name -> LoraConfig (None: full-parameter)
    "all": types.LoraConfig(rank=4, seed=1),
    "attn": types.LoraConfig(rank=2, seed=2, train_mlp=False, train_unembed=False),
    "mlp_head": types.LoraConfig(rank=3, seed=3, train_attn=False),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return BaseModels(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def base(bases):
    return bases.get("tiny:0")


def batch(seed: int, lengths=(7, 4), weights_sign: float = 1.0, forward_only: bool = False) -> ForwardBackwardBatch:
    g = torch.Generator().manual_seed(seed)
    data = []
    for n in lengths:
        tokens = torch.randint(3, 100, (n,), generator=g)
        targets = torch.cat([tokens[1:], torch.randint(3, 100, (1,), generator=g)])
        weights = weights_sign * torch.rand(n, generator=g)
        data.append(Datum(tokens=tokens, inputs={"target_tokens": targets, "weights": weights}))
    return ForwardBackwardBatch(model_id="m", seq_id=1, loss_fn="cross_entropy", loss_config={},
                                forward_only=forward_only, data=data)


def randomized(tenant: TenantModel, seed: int) -> TenantModel:
    """B starts at 0 (the adapter is the base): draw every adapter tensor so that it is not."""
    g = torch.Generator().manual_seed(seed)
    tenant.adapter.load({k: 0.05 * torch.randn(t.shape, generator=g) for k, t in tenant.adapter.state().items()})
    return tenant


def merged_logprobs(base, tenant: TenantModel, b: ForwardBackwardBatch) -> list[torch.Tensor]:
    """Independent: a copy of the base with W + scaling * B @ A merged into every target, full logits."""
    model = copy.deepcopy(base.model)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # untie: the LoRA is on the output only
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (a, bb) in tenant.adapter.weights.items():
            modules[name].weight += tenant.adapter.scaling * bb @ a
        out = []
        for d in b.data:
            logits = model(input_ids=d.tokens[None]).logits[0].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, d.inputs["target_tokens"][:, None])[:, 0])
    return out


def test_lora_logprobs_and_loss_match_a_merged_model(base):
    for seed, lora in enumerate(LORAS.values()):
        tenant = randomized(TenantModel(base, lora), seed)
        b = batch(seed)
        logprobs, metrics = tenant.forward_backward(b)
        expected = merged_logprobs(base, tenant, b)
        for got, want in zip(logprobs, expected):
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        want_loss = -sum(float((w * d.inputs["weights"]).sum()) for w, d in zip(expected, b.data))
        assert metrics["loss:sum"] == pytest.approx(want_loss, rel=1e-5)


def trained(tenant: TenantModel) -> list[torch.nn.Parameter]:
    return tenant.optimizer.params


def test_batched_tenants_equal_each_alone(base):
    """Three LoRA tenants (one forward over the base), a forward-only LoRA item and a full-parameter tenant in one
    call: each gets what it gets alone, and so do its gradients and, after optim_step, its weights."""
    tenants = {**LORAS, "full": None}

    def make(i: int, k: str) -> TenantModel:
        return TenantModel(base, None) if tenants[k] is None else randomized(TenantModel(base, tenants[k]), i)

    alone = {k: make(i, k) for i, k in enumerate(tenants)}
    together = {k: make(i, k) for i, k in enumerate(tenants)}
    batches = {k: batch(10 + i, lengths=(5 + i, 9 - i), weights_sign=(-1) ** i) for i, k in enumerate(tenants)}
    probe = batch(19, forward_only=True)  # forward-only rows of one tenant, beside its training rows
    for _ in range(2):  # two steps: the second runs on the weights the first optim_step wrote
        expected = {k: alone[k].forward_backward(batches[k]) for k in tenants}
        expected_probe = alone["all"].forward_backward(probe)
        got = forward_backward_many([(together[k], batches[k]) for k in tenants] + [(together["all"], probe)])
        for (logprobs, metrics), want in zip(got, [*expected.values(), expected_probe]):
            for a, b in zip(logprobs, want[0]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            assert metrics["loss:sum"] == pytest.approx(want[1]["loss:sum"], abs=1e-5)
        for k in tenants:
            for p, q in zip(trained(together[k]), trained(alone[k])):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5)
        for k in tenants:
            assert together[k].optim_step(ADAM)["grad_norm:mean"] > 0
            alone[k].optim_step(ADAM)
            for p, q in zip(trained(together[k]), trained(alone[k])):
                torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", ["all", "attn"])
def test_chunked_recomputed_head_gives_the_same_logprobs_and_grads(base, monkeypatch, lora):
    """Chunks of 3 rows, recomputed in the backward (nothing kept), equal the kept single chunk."""
    import rollwise.service.multi_lora as multi_lora

    b = batch(70)
    runs = []
    for chunk, keep_mib in ((1024, 512), (3, 0)):
        monkeypatch.setattr(multi_lora, "CHUNK_TOKENS", chunk)
        monkeypatch.setattr(multi_lora, "KEEP_PROBS_MIB", keep_mib)
        tenant = randomized(TenantModel(base, LORAS[lora]), 7)
        logprobs, _ = tenant.forward_backward(b)
        runs.append((logprobs, [p.grad for p in tenant.adapter.parameters()]))
    for a, b_ in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-5)


def test_gradients_accumulate_until_optim_step_and_forward_only_keeps_none(base):
    tenant = randomized(TenantModel(base, LORAS["all"]), 5)
    b1, b2 = batch(20, lengths=(6,)), batch(21, lengths=(8,))
    tenant.forward_backward(batch(22, forward_only=True))
    assert all(p.grad is None for p in tenant.adapter.parameters())
    tenant.forward_backward(b1)
    tenant.forward_backward(b2)
    accumulated = [p.grad.clone() for p in tenant.adapter.parameters()]
    tenant.optimizer.zero_grad()
    both = ForwardBackwardBatch("m", 1, "cross_entropy", {}, False, b1.data + b2.data)
    forward_backward_many([(tenant, both)])
    for p, g in zip(tenant.adapter.parameters(), accumulated):
        torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-5)
    before = [p.detach().clone() for p in tenant.adapter.parameters()]
    tenant.optim_step(ADAM)
    assert all(p.grad is None for p in tenant.adapter.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(tenant.adapter.parameters(), before))


@pytest.mark.parametrize("lora", [LORAS["all"], None], ids=["lora", "full"])
def test_save_and_load_state_resume_bit_exact(bases, base, tmp_path, lora):
    base_before = {k: v.clone() for k, v in base.model.state_dict().items()}
    run = TenantModel(base, lora, seed=7)
    for step in range(2):
        run.forward_backward(batch(30 + step))
        run.optim_step(ADAM)
    run.save_state(tmp_path / "ckpt", optimizer=True)
    # a fresh model (random init) of the checkpoint's settings: everything must come from the checkpoint
    resumed = TenantModel.from_checkpoint(bases, tmp_path / "ckpt", optimizer=True)
    assert (resumed.base, resumed.lora_rank) == (base, run.lora_rank)
    assert resumed.steps == 2
    for tenant in (run, resumed):
        tenant.forward_backward(batch(32))
        tenant.optim_step(ADAM)
    for p, q in zip(trained(run), trained(resumed)):
        assert torch.equal(p, q)
    # weights only: the same weights, a fresh optimizer
    fresh = TenantModel(base, lora, seed=9)
    fresh.load_state(tmp_path / "ckpt", optimizer=False)
    assert fresh.steps == 0
    assert all(torch.equal(v, base_before[k]) for k, v in base.model.state_dict().items())  # base untouched


# PEFT warns that lm_head is tied to the embeddings: the adapter is on the output projection only, as intended.
@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_lora_checkpoint_is_peft_format(base, tmp_path):
    from peft import PeftModel

    tenant = randomized(TenantModel(base, LORAS["mlp_head"]), 6)
    tenant.save_state(tmp_path / "peft", optimizer=False)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base.model), tmp_path / "peft")
    b = batch(60, lengths=(9,), forward_only=True)
    (logprobs,), _ = tenant.forward_backward(b)
    with torch.no_grad():
        logits = peft_model(input_ids=b.data[0].tokens[None]).logits[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, b.data[0].inputs["target_tokens"][:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)


def test_sampler_weights_are_snapshots_the_engine_accepts(base):
    tenant = randomized(TenantModel(base, LORAS["attn"]), 3)
    snap = tenant.sampler_weights(name="job-1")
    spec, state = snap.adapter
    assert (snap.base_model, snap.version, spec.rank, spec.alpha) == ("tiny:0", 1, 2, 32.0)
    assert set(spec.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    AdapterSet(projection_targets(base.model)).check(spec, state)  # names and shapes the engine applies
    frozen = {k: v.clone() for k, v in state.items()}
    tenant.forward_backward(batch(40))
    tenant.optim_step(ADAM)
    assert all(torch.equal(state[k], frozen[k]) for k in state)  # training on does not move the snapshot
    assert tenant.sampler_weights().version == 2
    full = TenantModel(base, None).sampler_weights()
    assert full.adapter is None and set(full.full_state) == set(base.model.state_dict())


def test_seeds_set_the_lora_init(base):
    def init(seed):
        return [p.detach() for p in TenantModel(base, types.LoraConfig(rank=2, seed=seed)).adapter.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(init(11), init(11)))
    assert not all(torch.equal(a, b) for a, b in zip(init(11), init(12)))
    init(-1)  # any int the client sends


def test_refusals_name_the_field_and_change_nothing(base, tmp_path):
    with pytest.raises(ServiceUserError, match="lora_config"):
        TenantModel(base, types.LoraConfig(rank=2, train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(ServiceUserError, match=r"lora_config\.rank"):
        TenantModel(base, types.LoraConfig(rank=0))
    tenant = randomized(TenantModel(base, LORAS["all"]), 4)
    before = [p.detach().clone() for p in tenant.adapter.parameters()]
    bad = batch(50)
    bad.data[1].inputs["target_tokens"][0] = base.vocab_size
    with pytest.raises(ServiceUserError, match=r"data\[1\]\.loss_fn_inputs\['target_tokens'\]"):
        forward_backward_many([(tenant, batch(51)), (tenant, bad)])
    assert all(p.grad is None for p in tenant.adapter.parameters())
    with pytest.raises(ServiceUserError, match="adam_params.beta1"):
        tenant.optim_step(types.AdamParams(beta1=1.5))
    tenant.save_state(tmp_path / "lora", optimizer=False)
    with pytest.raises(ServiceUserError, match="path: .*LoRA rank 4"):
        TenantModel(base, types.LoraConfig(rank=8)).load_state(tmp_path / "lora", optimizer=False)
    with pytest.raises(ServiceUserError, match="path: .*no optimizer state"):
        tenant.load_state(tmp_path / "lora", optimizer=True)
    assert all(torch.equal(p, q) for p, q in zip(tenant.adapter.parameters(), before))
