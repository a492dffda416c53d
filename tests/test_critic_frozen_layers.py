"""train.gae.critic_trainable_layers (issue 41, PPO+GAE's step cost): a critic that trains only its top k decoder
layers, the final norm and the value head. Its values and its trainable parameters' gradients equal a full critic's
(whose lower layers' gradients are then thrown away), computed here with a plain padded forward; no autograd graph
and no saved activations below the first trainable layer; a trainer's steps leave the frozen parameters at the
policy's initial weights while the top layers learn; a checkpoint resumes with the same k and refuses another,
naming the field; a k the model cannot take, or a k without a critic, is refused naming the field before any step.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from rollwise.config import ConfigError, RunError, load_config
from rollwise.model.tiny import tiny_llama, tiny_tokenizer
from rollwise.train.advantages import assign_advantages
from rollwise.train.critic import VALUE_LOSS, Critic
from rollwise.train.sharded import ShardedTrainer
from rollwise.train.trainer import GRPOTrainer
from rollwise.types.sample import Sample
from rollwise.types.train_config import TrainConfig, TrainerConfig

pytestmark = pytest.mark.usefixtures("single_torch_thread")

N_LAYERS, K = 4, 2
FIELD = "train.gae.critic_trainable_layers"


def _cfg(k: int | None = K, **more) -> TrainConfig:
    return TrainConfig(advantage="gae", lr=1e-3, micro_batch_size=4,
                       gae={"critic_lr": 1e-2, "lam": 1.0, "critic_trainable_layers": k}, **more)


@dataclass
class PaddedRows:
    """A PredictorBatch of its own (rollwise.train.critic): right-padded rows through the plain forward, the hidden
    states at the positions that predict each row's response tokens."""

    ids: Tensor  # [B, T]
    prompt_len: int
    response_len: int
    padding: bool = False

    def hidden(self, backbone: nn.Module) -> tuple[Tensor, Tensor]:
        h = backbone(input_ids=self.ids).last_hidden_state
        span = slice(self.prompt_len - 1, self.prompt_len - 1 + self.response_len)
        return h[:, span].reshape(-1, h.shape[-1]), self.ids[:, span.start + 1: span.stop + 1].reshape(-1)


def _rows(seed: int = 0) -> PaddedRows:
    g = torch.Generator().manual_seed(seed)
    return PaddedRows(torch.randint(3, 60, (3, 9), generator=g), prompt_len=4, response_len=5)


def _critics() -> tuple[Critic, Critic]:
    """The same policy's critic, top-K trainable and full, with the same random (non-zero) value head."""
    policy = tiny_llama(seed=11, num_layers=N_LAYERS)
    part, full = Critic(policy, _cfg(K)), Critic(policy, _cfg(None))
    torch.manual_seed(0)
    head = torch.randn_like(full.model.head.weight)
    with torch.no_grad():
        for critic in (part, full):
            critic.model.head.weight.copy_(head)
            critic.model.head.bias.fill_(0.3)
    return part, full


def _is_frozen(name: str) -> bool:
    """Frozen at K=2 of 4: the embedding and layers 0 and 1 (norm, top layers and head train)."""
    return name.startswith(("backbone.embed_tokens.", "backbone.layers.0.", "backbone.layers.1."))


def test_values_and_gradients_equal_the_full_critics_trainable_part():
    part, full = _critics()
    rows = _rows()
    weights = torch.linspace(-1.0, 2.0, 15)
    values = {}
    for name, critic in (("part", part), ("full", full)):
        v = critic.model(rows)
        (v * weights).sum().backward()
        values[name] = v.detach()
    torch.testing.assert_close(values["part"], values["full"], rtol=0, atol=0)
    full_grads = dict(full.model.named_parameters())
    for name, p in part.model.named_parameters():
        if _is_frozen(name):
            assert not p.requires_grad and p.grad is None, name
        else:  # the full critic's gradient, its lower layers' simply discarded
            assert p.requires_grad and p.grad is not None, name
            torch.testing.assert_close(p.grad, full_grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    assert set(part.optimizer.param_groups[0]["params"]) == {p for p in part.model.parameters() if p.requires_grad}


def test_no_graph_and_no_saved_activations_below_the_first_trainable_layer():
    part, full = _critics()
    outputs: dict[int, Tensor] = {}
    hooks = [layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
             for i, layer in enumerate(part.model.backbone.layers)]
    saved: dict[str, int] = {}
    for name, critic in (("part", part), ("full", full)):
        count = [0]

        def pack(t: Tensor, count=count) -> Tensor:
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            critic.model(_rows())
        saved[name] = count[0]
    for hook in hooks:
        hook.remove()
    for i, out in outputs.items():
        assert (out.grad_fn is not None) == (i >= N_LAYERS - K), i  # a graph from the first trainable layer on
    # about K of N_LAYERS layers' activations (the embedding's gather and the frozen layers' none)
    assert 0 < saved["part"] < 0.6 * saved["full"], saved


def _batch() -> list[Sample]:
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0]
    out = [Sample(sample_id=f"s{i}", group_id=f"g{i // 3}", problem_id="p", prompt_ids=[5, 6, 7 + i // 3],
                  response_ids=[(8 + i + t) % 60 + 3 for t in range(2 + i % 3)],
                  behaviour_logprobs=[-2.0] * (2 + i % 3), versions=[0] * (2 + i % 3), finish_reason="stop",
                  reward=r) for i, r in enumerate(rewards)]
    assign_advantages(out, "gae")
    return out


def _trainer(k: int | None) -> GRPOTrainer:
    return GRPOTrainer(tiny_llama(seed=5, num_layers=N_LAYERS), _cfg(k), pad_token_id=0, tokenizer=tiny_tokenizer())


def test_steps_train_the_top_layers_only_and_the_checkpoint_resumes_the_same_k(tmp_path):
    trainer = _trainer(K)
    initial = {n: t.clone() for n, t in trainer.critic.model.state_dict().items()}
    batch = _batch()
    first = trainer.train_step(copy.deepcopy(batch))
    second = trainer.train_step(copy.deepcopy(batch))  # the head is non-zero now: the top layers get gradients
    assert second[VALUE_LOSS] < first[VALUE_LOSS]
    for name, t in trainer.critic.model.state_dict().items():
        if "rotary" in name:
            continue
        assert torch.equal(t, initial[name]) == _is_frozen(name), name  # frozen kept, the trainable all moved

    ckpt = trainer.save_checkpoint(tmp_path, 2, {}, keep_last=1)
    resumed = _trainer(K)
    resumed.load_checkpoint(ckpt)
    want, got = trainer.train_step(copy.deepcopy(batch)), resumed.train_step(copy.deepcopy(batch))
    assert got[VALUE_LOSS] == want[VALUE_LOSS] and got["loss"] == want["loss"]
    for other in (1, None):  # another k: its optimizer state covers other parameters
        refused = _trainer(other)
        before = {n: t.clone() for n, t in refused.critic.model.state_dict().items()}
        with pytest.raises(RunError, match=FIELD.replace(".", r"\.")):
            refused.load_checkpoint(ckpt)
        assert all(torch.equal(t, before[n]) for n, t in refused.critic.model.state_dict().items())


def test_a_k_beyond_the_model_is_refused_naming_the_field_and_the_layer_count():
    with pytest.raises(ConfigError, match=rf"{FIELD.replace('.', '[.]')}=5, but the model has 4 decoder layers"):
        _trainer(5)


@pytest.mark.parametrize("overrides", [[f"{FIELD}=2"],  # no critic: train.advantage is mean_std
                                       ["train.advantage=gae", f"{FIELD}=0"]])
def test_refused_in_the_config_naming_the_field(overrides):
    with pytest.raises(ConfigError, match=FIELD.replace(".", "[.]")):
        load_config(None, overrides)
    assert load_config(None, ["train.advantage=gae", f"{FIELD}=2"]).train.gae.critic_trainable_layers == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="2 ranks need 2 CPU cores")
def test_two_ranks_train_the_same_partly_frozen_critic_and_checkpoint_it(tmp_path):
    """FSDP2 units whose parameters take no gradient (the frozen layers) beside trainable ones: the same critic as
    one process after a step, and its checkpoint (optimizer shards over the trainable parameters) resumes in one
    process."""
    cfg = _cfg(K, off_policy_correction="none")
    tok = tiny_tokenizer()
    single = GRPOTrainer(tiny_llama(seed=3, num_layers=N_LAYERS), cfg, pad_token_id=0, tokenizer=tok)
    sharded = ShardedTrainer(tiny_llama(seed=3, num_layers=N_LAYERS), cfg, TrainerConfig(world_size=2, device="cpu"),
                             pad_token_id=0, tokenizer=tok)
    try:
        for _ in range(2):
            one, two = single.train_step(_batch()), sharded.train_step(_batch())
            assert two[VALUE_LOSS] == pytest.approx(one[VALUE_LOSS], rel=1e-5)
        ckpt = sharded.save_checkpoint(tmp_path, 2, {}, keep_last=1)
    finally:
        sharded.close()
    saved = load_file(ckpt / "critic" / "value_model.safetensors")
    for name, t in single.critic.model.state_dict().items():  # each trainable weight moved ~7e-3 (AdamW at 1e-2);
        # a gradient not summed over the ranks would be that far off, float round-off through Adam is ~1e-4
        torch.testing.assert_close(saved[name], t, rtol=0, atol=0 if _is_frozen(name) else 2e-4, msg=name)
    resumed = GRPOTrainer(tiny_llama(seed=3, num_layers=N_LAYERS), cfg, pad_token_id=0, tokenizer=tok)
    resumed.load_checkpoint(ckpt)
    assert resumed.train_step(_batch())[VALUE_LOSS] == pytest.approx(single.train_step(_batch())[VALUE_LOSS], rel=1e-4)
