"""One tenant's trained model in the Tinker service: a LoRA adapter over a shared frozen base model, or a
full-parameter copy of the base; forward(_backward) with gradients accumulated until `optim_step`, AdamW,
bit-exact save/load, and snapshots for the sampler.

`forward_backward_many` runs many tenants' batches at once: all LoRA tenants of one base in ONE forward
(and one backward) over the base, each row with its own adapter (rollwise.service.multi_lora); each
full-parameter tenant over its own copy. What each tenant gets equals what it gets alone (up to float
summation order; tests/test_tinker_tenant_model.py checks 1e-5).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import safetensors.torch
import torch
from tinker import types
from torch import Tensor, nn

from rollwise.service.base_models import BaseModel, BaseModels, SamplerWeights
from rollwise.service.datums import ForwardBackwardBatch
from rollwise.service.errors import ServiceUserError
from rollwise.service.losses import check_loss, compute_loss
from rollwise.service.prefix_share import head_inputs, plan_prefixes, prefix_shared_hidden
from rollwise.service.multi_lora import LORA_ALPHA, MultiLora, RowGroup, TenantAdapter, lora_modules, target_logprobs
from rollwise.service.tenant_checkpoint import (
    FULL_FILE, TenantCheckpoint, check_meta, lora_config_of, read_adapter, read_meta, save_adapter, write_meta)
from rollwise.service.tenant_optimizer import TenantOptimizer
from rollwise.train.logprobs import backbone_of
from rollwise.types.weights import AdapterSpec

# Beyond this a LoRA is no low-rank adapter (and its lm_head B alone would take rank x vocab floats).
MAX_LORA_RANK = 512
Result = tuple[list[Tensor], dict[str, float]]
LossFn = Callable[[str, dict[str, float], list[Tensor], list], tuple[Tensor, dict[str, float]]]


class TenantModel:
    """`lora` None: full-parameter training of a copy of `base.model`; else a LoRA adapter of `lora.rank` on
    the targets its train_attn / train_mlp / train_unembed select, alpha 32 (see multi_lora.LORA_ALPHA),
    initialised from `seed` (else lora.seed, else at random)."""

    def __init__(self, base: BaseModel, lora: types.LoraConfig | None, seed: int | None = None) -> None:
        self.base = base
        self.lock = threading.Lock()  # a full-parameter tenant's own model: one forward+backward at a time
        self.adapter: TenantAdapter | None = None
        self.model: nn.Module | None = None
        self.version = 0  # sampler snapshots taken
        if lora is None:
            # Under the base's lock: no training forward over it meanwhile (the worker's sampling thread creates
            # tenants for checkpoints while LoRA tenants train), whose per-row LoRA state the copy would take along.
            with base.lock:
                self.model = copy.deepcopy(base.model)
            self.model.requires_grad_(True)
            params = list(self.model.parameters())  # tied weights once
        else:
            if not 1 <= lora.rank <= MAX_LORA_RANK:
                raise ServiceUserError(f"lora_config.rank must be in [1, {MAX_LORA_RANK}], got {lora.rank}")
            modules = lora_modules(base.model, attn=lora.train_attn, mlp=lora.train_mlp, unembed=lora.train_unembed)
            if not modules:
                raise ServiceUserError("lora_config: train_attn, train_mlp and train_unembed select no layer of "
                                       f"{base.name!r}; set at least one of them")
            self.adapter = TenantAdapter(modules, lora.rank, LORA_ALPHA, seed if seed is not None else lora.seed)
            params = self.adapter.parameters()
        self.optimizer = TenantOptimizer(params)

    @classmethod
    def from_checkpoint(cls, bases: BaseModels, path: Path, *, optimizer: bool) -> TenantModel:
        """create-from-checkpoint: a model of the checkpoint's base model and LoRA settings, loaded from `path`."""
        meta = read_meta(Path(path))
        tenant = cls(bases.get(meta.base_model), lora_config_of(meta))
        tenant.load_state(Path(path), optimizer=optimizer)
        return tenant

    @property
    def is_lora(self) -> bool:
        return self.adapter is not None

    @property
    def lora_rank(self) -> int | None:
        return None if self.adapter is None else self.adapter.rank

    @property
    def steps(self) -> int:
        return self.optimizer.steps

    # ---------------------------------------------------------------- training

    def check(self, batch: ForwardBackwardBatch) -> None:
        """Everything `batch` can get wrong, as ServiceUserError naming the field, before anything runs (the
        worker calls this per request and batches only the ones that pass)."""
        check_loss(batch.loss_fn, batch.loss_config, batch.data)
        vocab, limit = self.base.vocab_size, self.base.max_context_length
        for i, datum in enumerate(batch.data):
            n = int(datum.tokens.numel())
            if n == 0:
                raise ServiceUserError(f"data[{i}].model_input has no tokens; send at least one")
            if n > limit:
                raise ServiceUserError(f"data[{i}].model_input has {n} tokens, more than {self.base.name!r}'s "
                                       f"context length {limit}; shorten it")
            for field, ids in (("model_input", datum.tokens), ("loss_fn_inputs['target_tokens']",
                                                                datum.inputs["target_tokens"])):
                if int(ids.min()) < 0 or int(ids.max()) >= vocab:
                    raise ServiceUserError(f"data[{i}].{field} holds token id {int(ids.max())} or "
                                           f"{int(ids.min())}, outside {self.base.name!r}'s vocabulary [0, {vocab})")

    def forward_backward(self, batch: ForwardBackwardBatch) -> Result:
        return forward_backward_many([(self, batch)])[0]

    def optim_step(self, adam: types.AdamParams) -> dict[str, float]:
        return self.optimizer.step(adam)

    # ---------------------------------------------------------------- checkpoints

    def _meta(self) -> TenantCheckpoint:
        if self.adapter is None:
            return TenantCheckpoint(kind="full", base_model=self.base.name)
        return TenantCheckpoint(kind="lora", base_model=self.base.name, rank=self.adapter.rank,
                                alpha=self.adapter.alpha, target_modules=list(self.adapter.target_modules))

    def save_state(self, path: Path, *, optimizer: bool) -> None:
        """Weights (and with `optimizer`, AdamW's moments and step) into the directory `path`."""
        path = Path(path)
        meta = self._meta()
        write_meta(path, meta)
        if self.adapter is not None:
            save_adapter(path, meta, self.adapter.state())
        else:
            safetensors.torch.save_model(self.model, str(path / FULL_FILE))  # tied weights once
            self.model.config.save_pretrained(path)
            self.base.tokenizer.save_pretrained(path)
        if optimizer:
            self.optimizer.save(path)

    def load_state(self, path: Path, *, optimizer: bool) -> None:
        """Weights from `path` exactly; with `optimizer` also AdamW's state (a bit-exact resume), else a fresh
        optimizer. Accumulated gradients are dropped. Everything is read and checked before anything changes."""
        path = Path(path)
        check_meta(path, read_meta(path), self._meta())
        saved_optimizer = self.optimizer.read(path) if optimizer else None
        if self.adapter is not None:
            state = read_adapter(path)
            try:
                self.adapter.load(state)
            except ValueError as exc:
                raise ServiceUserError(f"path: {exc}") from exc
        else:
            file = path / FULL_FILE
            if not file.is_file():
                raise ServiceUserError(f"path: checkpoint {path.name!r} holds no {FULL_FILE}")
            missing, unexpected = safetensors.torch.load_model(self.model, str(file), strict=False)
            if missing or unexpected:  # checked by the meta already; a damaged file is still refused loudly
                raise ServiceUserError(f"path: {FULL_FILE} of {path.name!r} does not match the model: missing "
                                       f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}")
        if saved_optimizer is not None:
            self.optimizer.apply(saved_optimizer)
        else:
            self.optimizer.reset()

    # ---------------------------------------------------------------- sampling

    def sampler_weights(self, name: str = "tenant") -> SamplerWeights:
        """A snapshot for the sampler (copies: training on does not change it); version +1 per call. LoRA:
        the adapter under AdapterSpec `name`; full: the state dict by HF names (tied tensors copied once)."""
        self.version += 1
        if self.adapter is not None:
            spec = AdapterSpec(name=name, rank=self.adapter.rank, alpha=self.adapter.alpha,
                               target_modules=self.adapter.target_modules)
            state = {k: t.clone() for k, t in self.adapter.state().items()}
            return SamplerWeights(base_model=self.base.name, version=self.version, adapter=(spec, state))
        copies: dict[int, Tensor] = {}
        full = {}
        for key, t in self.model.state_dict().items():
            full[key] = copies.setdefault(t.data_ptr(), t.detach().clone())
        return SamplerWeights(base_model=self.base.name, version=self.version, full_state=full)


def forward_backward_many(items: Sequence[tuple[TenantModel, ForwardBackwardBatch]],
                          loss: LossFn = compute_loss) -> list[Result]:
    """Each item's per-datum target logprobs (float32, detached, shaped as its target_tokens) and metrics, in
    order. Items that are not forward_only add their loss's gradients to their tenant's (accumulated until
    optim_step). LoRA tenants of one base share one forward; items of one tenant may repeat (consecutive
    chunks). Every batch is checked first: a bad one raises ServiceUserError and nothing runs."""
    for tenant, batch in items:
        tenant.check(batch)
    passes: dict[tuple[int, bool], list[int]] = {}
    for index, (tenant, batch) in enumerate(items):
        owner = id(tenant.base) if tenant.is_lora else id(tenant)
        passes.setdefault((owner, batch.forward_only), []).append(index)
    results: list[Result | None] = [None] * len(items)
    for (_, forward_only), indices in passes.items():
        chosen = [items[i] for i in indices]
        for index, result in zip(indices, _run_pass(chosen, grad=not forward_only, loss=loss)):
            results[index] = result
    return results  # type: ignore[return-value]


def _run_pass(items: list[tuple[TenantModel, ForwardBackwardBatch]], *, grad: bool, loss: LossFn) -> list[Result]:
    """One forward (and backward when `grad`) over one model: the shared base for LoRA tenants, else the
    tenant's own copy. Rows are the items' datums in order, right-padded; where datums of one model start with
    the same tokens, those run once for them (rollwise.service.prefix_share, the trainer's shared-prompt forward)."""
    first = items[0][0]
    model = first.base.model if first.is_lora else first.model
    hooks: MultiLora | None = first.base.lora if first.is_lora else None
    lock = first.base.lock if first.is_lora else first.lock
    rows = [d.tokens for _, batch in items for d in batch.data]
    adapters = [tenant.adapter for tenant, batch in items for _ in batch.data]
    groups = [RowGroup(tenant.adapter, len(batch.data)) for tenant, batch in items]
    # datums of one model (the same adapter, or the full tenant's own copy) that start alike share that prefix
    layout = plan_prefixes(rows, [id(a) for a in adapters])
    head = model.get_output_embeddings()
    results: list[Result] = []
    with lock, torch.set_grad_enabled(grad):
        if layout is None:
            hidden = _padded_hidden(model, rows, hooks.rows(groups) if hooks is not None else None)
        else:
            prompt_groups = _row_groups([adapters[members[0]] for members in layout.groups])
            hidden = prefix_shared_hidden(backbone_of(model), rows, layout,
                                          hooks.rows(prompt_groups) if hooks is not None else None,
                                          hooks.rows(groups) if hooks is not None else None)
        total: Tensor | None = None
        prefixes = None if layout is None else layout.prefix_of_rows(len(rows))
        row = 0
        for tenant, batch in items:
            logprobs = _item_logprobs(head, hidden[row : row + len(batch.data)], batch, tenant.adapter,
                                      None if prefixes is None else prefixes[row : row + len(batch.data)])
            row += len(batch.data)
            value, metrics = loss(batch.loss_fn, batch.loss_config, logprobs, batch.data)
            if grad and value.requires_grad:
                total = value if total is None else total + value
            results.append(([lp.detach() for lp in logprobs], metrics))
        if total is not None:
            total.backward()  # each tenant's loss reaches only its own parameters
    return results


def _padded_hidden(model: nn.Module, rows: list[Tensor], scope: AbstractContextManager | None) -> list[Tensor]:
    """Each row's last hidden states, the rows right-padded into one forward."""
    length = max(int(t.numel()) for t in rows)
    input_ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    for r, tokens in enumerate(rows):
        input_ids[r, : tokens.numel()] = tokens
        attention_mask[r, : tokens.numel()] = 1
    with scope if scope is not None else nullcontext():
        hidden = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return [hidden[r, : int(tokens.numel())] for r, tokens in enumerate(rows)]


def _row_groups(adapters: list[TenantAdapter | None]) -> list[RowGroup]:
    """Runs of consecutive rows with the same adapter."""
    groups: list[RowGroup] = []
    for adapter in adapters:
        if groups and groups[-1].adapter is adapter:
            groups[-1] = RowGroup(adapter, groups[-1].rows + 1)
        else:
            groups.append(RowGroup(adapter, 1))
    return groups


def _item_logprobs(head: nn.Module, hidden: Sequence[Tensor], batch: ForwardBackwardBatch,
                   adapter: TenantAdapter | None, prefixes: Sequence[tuple[int, int]] | None) -> list[Tensor]:
    """Per datum: log p(target_tokens[t] (, k) | tokens[:t+1]), shaped as target_tokens ([N] or [N, K]), from
    `hidden` (the item's datums' last hidden states, [N, H] each); one chunked LM-head call for the whole item,
    a shared prefix's positions once for its group (prefix_share.head_inputs)."""
    targets = [d.inputs["target_tokens"] for d in batch.data]
    rows, row_targets, index = head_inputs(hidden, targets, prefixes)
    flat = target_logprobs(head, rows, row_targets, adapter)
    return [flat[where].view(t.shape) for where, t in zip(index, targets)]
