"""A compact Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Mixtral) that runs against a slot-based KV cache.

The module tree mirrors Hugging Face's, so parameter names match HF state_dict names exactly
(`model.layers.0.self_attn.q_proj.weight`, ...) and trainer weights load by name. The numerics
follow HF's implementation (fp32 RMSNorm, the same RoPE formula, SDPA), so logprobs agree with a
full HF forward pass to ~1e-6 in fp32.

For speed on CPU, q/k/v and gate/up each live in one fused matrix (one matmul instead of three or
two); the HF-named parameters are views into it, so loading `q_proj.weight` by name writes straight
into the fused storage. Consequently the model must never be moved or cast after construction
(`.to()` would break the views): pick the dtype when building it.

Why this file runs just past ~400 lines: the module tree must mirror Hugging Face's in one place so that
parameter names match state-dict names, and its forward paths over the KV cache sit beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollwise.engine.reference.model_config import ModelConfig

# attend(q [T, H, D], k [T, KV, D], v [T, KV, D]) -> [T, H * D]; stores k/v in the cache first.
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


class Linear(nn.Module):
    """An HF-named weight (and optional bias); the tensors may be views into a fused matrix."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))

    # LoRA adapters (rollwise.engine.reference.lora): hook(x, y) adds each row's adapter delta to y.
    lora_hook: Callable[[Tensor, Tensor], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_hook is not None:
            self.lora_hook(x, y)
        return y


def _new_linear(out_dim: int, in_dim: int, bias: bool, dtype: torch.dtype) -> Linear:
    # torch.empty: every parameter is overwritten by load_weights, so random init would be wasted time.
    return Linear(torch.empty(out_dim, in_dim, dtype=dtype), torch.empty(out_dim, dtype=dtype) if bias else None)


def _register_fused(
    parent: nn.Module, names: list[str], out_dims: list[int], in_dim: int, bias: bool, dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """Register `names` as Linear children of `parent` whose parameters are row-slices of one fused
    weight (and bias); return the fused tensors, which are plain attributes and not in state_dict."""
    weight = torch.empty(sum(out_dims), in_dim, dtype=dtype)
    bias_t = torch.empty(sum(out_dims), dtype=dtype) if bias else None
    biases = bias_t.split(out_dims) if bias_t is not None else [None] * len(out_dims)
    for name, w, b in zip(names, weight.split(out_dims), biases):
        parent.add_module(name, Linear(w, b))
    return weight, bias_t


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # HF's LlamaRMSNorm op order: normalise in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        shape = cfg.shape
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        q_dim, kv_dim = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.split = [q_dim, kv_dim, kv_dim]
        self.qkv_weight, self.qkv_bias = _register_fused(
            self, ["q_proj", "k_proj", "v_proj"], self.split, cfg.shape.hidden_size, cfg.qkv_bias, dtype
        )
        self.o_proj = _new_linear(cfg.shape.hidden_size, q_dim, cfg.o_bias, dtype)
        if cfg.qk_norm:  # Qwen3: each head of q and k is RMS-normalised before RoPE (HF's q_norm/k_norm)
            self.q_norm = RMSNorm(cfg.shape.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.shape.head_dim, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.lora_fused = (["q_proj", "k_proj", "v_proj"], self.split)  # for LoRA hooks on the fused matmul
        self.lora_hook: Callable[[Tensor, Tensor], None] | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        T = x.shape[0]
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        if self.lora_hook is not None:
            self.lora_hook(x, qkv)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return self.o_proj(attend(q, k, v))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = cfg.shape.intermediate_size
        self.gate_up_weight, self.gate_up_bias = _register_fused(
            self, ["gate_proj", "up_proj"], [self.intermediate_size] * 2, cfg.shape.hidden_size, cfg.mlp_bias, dtype
        )
        self.down_proj = _new_linear(cfg.shape.hidden_size, cfg.shape.intermediate_size, cfg.mlp_bias, dtype)
        self.lora_fused = (["gate_proj", "up_proj"], [cfg.shape.intermediate_size] * 2)
        self.lora_hook: Callable[[Tensor, Tensor], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        gate_up = F.linear(x, self.gate_up_weight, self.gate_up_bias)
        if self.lora_hook is not None:
            self.lora_hook(x, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    """HF Mixtral's `mlp.experts`: every expert's SwiGLU weights stacked in 3-D tensors."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.shape.hidden_size, cfg.shape.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I, dtype=dtype), requires_grad=False)


class SparseMoE(nn.Module):
    """HF Mixtral's sparse MoE block: softmax router, top-k experts, weights renormalised over the k.

    The experts each token went to are kept in `last_experts` [T, top_k] after every forward: the
    engine returns them with the sample (routing capture), so the trainer can replay them (R3).
    The arithmetic follows HF's (fp32 router probabilities, experts summed in ascending expert order).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = _new_linear(cfg.num_experts, cfg.shape.hidden_size, False, dtype)  # the router
        self.experts = Experts(cfg, dtype)
        self.last_experts: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.last_experts = experts
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype)
        self.mlp = SparseMoE(cfg, dtype) if cfg.num_experts else MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.shape.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.shape.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        # Only the weight is used (through F.embedding); Linear is just the HF-named holder.
        self.embed_tokens = Linear(torch.empty(cfg.shape.vocab_size, cfg.shape.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.shape.num_layers))
        self.norm = RMSNorm(cfg.shape.hidden_size, cfg.rms_norm_eps, dtype)


class KVCache:
    """Preallocated per-slot KV cache: k and v are [num_layers, num_slots, num_kv_heads, max_len, head_dim].

    A slot holds one sequence; `lengths[slot]` is how many of its positions are filled. Zero-filled
    (not empty) because masked-out positions still enter the attention matmul with weight 0, and
    0 * NaN from uninitialised memory would poison the output.
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype) -> None:
        shape = (cfg.shape.num_layers, num_slots, cfg.shape.num_kv_heads, max_len, cfg.shape.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.lengths = [0] * num_slots

    def share_prefix(self, slots: list[int], length: int) -> None:
        """The first slot holds `length` freshly computed positions: copy them to the other slots (samples
        of one request share their prompt) and mark every slot filled up to `length`."""
        first = slots[0]
        if len(slots) > 1:
            others = torch.tensor(slots[1:])
            self.k[:, others, :, :length] = self.k[:, first : first + 1, :, :length]
            self.v[:, others, :, :length] = self.v[:, first : first + 1, :, :length]
        for slot in slots:
            self.lengths[slot] = length


class PromptScores(NamedTuple):
    """What `LlamaFamilyModel.prompt_logprobs` computes at prompt positions 1..P-1 (fp32 log-softmax, temperature 1
    unless asked)."""

    chosen: Tensor  # [P - 1]: log p(token_ids[i] | token_ids[:i])
    top_ids: Tensor  # [P - 1, top_k]: the most likely tokens at each position, best first
    top_logprobs: Tensor  # [P - 1, top_k]
    targets: Tensor  # [P - 1, K]: the asked-for targets' logprobs (0.0 where the id was -1)


class LlamaFamilyModel(nn.Module):
    """Llama/Mistral/Qwen2/Qwen3/Mixtral decoder with prefill and batched-decode entry points over a KVCache."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = Backbone(cfg, dtype)
        if cfg.tie_word_embeddings:
            # Shares storage with the embedding, so loading either name updates both.
            self.lm_head = Linear(self.model.embed_tokens.weight)
        else:
            self.lm_head = _new_linear(cfg.shape.vocab_size, cfg.shape.hidden_size, False, dtype)
        # HF's RoPE inverse frequencies for the configured type (same formula: identical cos/sin).
        self.inv_freq = cfg.inv_freq()
        self.rope_scale = cfg.rope_attention_scaling
        # MoE only: the experts chosen for the tokens of the latest forward, [T, num_layers, top_k].
        self.last_routing: Tensor | None = None
        self.capture_routing = self.is_moe  # the engine turns it off to measure what capture costs

    @property
    def is_moe(self) -> bool:
        return self.config.num_experts > 0

    @classmethod
    def from_hf(cls, hf_model: nn.Module, dtype: torch.dtype | None = None) -> LlamaFamilyModel:
        """Copy an HF *ForCausalLM's config and weights (the result owns its own tensors)."""
        return cls.from_config(hf_model.config, hf_model.state_dict(), dtype or next(hf_model.parameters()).dtype)

    @classmethod
    def from_config(
        cls, hf_config: Any, state_dict: Mapping[str, Tensor], dtype: torch.dtype = torch.float32
    ) -> LlamaFamilyModel:
        model = cls(ModelConfig.from_hf(hf_config), dtype)
        model.load_weights(state_dict, require_all=True)
        return model

    def load_weights(self, state_dict: Mapping[str, Tensor], *, require_all: bool = False) -> None:
        """Copy tensors in by HF name, casting dtype. Every name and shape is validated before anything
        is copied, so a bad state_dict raises ValueError and leaves the current weights untouched."""
        params = dict(self.named_parameters(remove_duplicate=False))
        problems: list[str] = []
        for name, tensor in state_dict.items():
            if name.endswith("rotary_emb.inv_freq"):  # a non-learned buffer some checkpoints carry
                continue
            if name not in params:
                problems.append(f"unexpected weight {name!r}")
            elif tuple(tensor.shape) != tuple(params[name].shape):
                problems.append(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(params[name].shape)}")
        if require_all:
            optional = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
            missing = [name for name in params if name not in state_dict and name not in optional]
            problems += [f"missing weight {name!r}" for name in missing]
        if problems:
            shown = "; ".join(problems[:10]) + (f"; ... ({len(problems)} problems)" if len(problems) > 10 else "")
            raise ValueError(f"cannot load weights: {shown}")
        targets = [(params[name], tensor) for name, tensor in state_dict.items() if name in params]
        with torch.no_grad():  # one fused copy over all tensors: 272 separate copy_ calls cost ~1.3x a memcpy
            torch._foreach_copy_([p for p, _ in targets], [t for _, t in targets])

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        window = self.config.sliding_window
        if window is not None and max_len > window:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's sliding window {window}; the reference engine "
                "implements full attention only, so keep max_model_len <= sliding_window"
            )
        return KVCache(self.config, num_slots, max_len, self.dtype)

    def _hidden(self, token_ids: Tensor, positions: Tensor, attend: Callable[..., Tensor]) -> Tensor:
        """Final-norm hidden states [T, hidden] for tokens at `positions`; `attend(layer, q, k, v)`."""
        x = F.embedding(token_ids, self.model.embed_tokens.weight)
        freqs = positions.float()[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        # [T, 1, head_dim], broadcast over heads; scaled in fp32 before the cast, as HF does.
        cos = (emb.cos() * self.rope_scale).to(self.dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scale).to(self.dtype)[:, None, :]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, functools.partial(attend, i))
        if self.capture_routing:
            self.last_routing = torch.stack([layer.mlp.last_experts for layer in self.model.layers], dim=1)
        return self.model.norm(x)

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()  # logprobs are always computed in fp32

    @torch.inference_mode()
    def prefill(self, cache: KVCache, token_ids: list[int], slots: list[int]) -> Tensor:
        """Run a prompt once into slots[0], copy its KV into the other slots (the n samples of a
        request share one prefill) and return fp32 logits [vocab] for the next token."""
        P = len(token_ids)
        first = slots[0]

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [KV, P, D]
            cache.k[layer, first, :, :P] = k
            cache.v[layer, first, :, :P] = v
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, enable_gqa=True)
            return out.transpose(0, 1).reshape(P, -1)

        hidden = self._hidden(torch.tensor(token_ids), torch.arange(P), attend)
        cache.share_prefix(slots, P)
        return self._logits(hidden[-1])

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], top_k: int = 0, targets: Tensor | None = None,
                        chunk: int = 512, temperature: float = 1.0) -> PromptScores:
        """Prompt scores (see PromptScores) at positions 1..P-1, no KV cache: the prefill's ops (causal attention
        over the whole sequence), the LM head a chunk of rows at a time. `targets`: int64 [P - 1, K] token ids to
        score at each position (-1: none, scored 0.0)."""
        P = len(token_ids)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 is_causal=True, enable_gqa=True)
            return out.transpose(0, 1).reshape(P, -1)

        hidden = self._hidden(torch.tensor(token_ids), torch.arange(P), attend)[:-1]
        prompt = torch.tensor(token_ids[1:])
        k = min(top_k, self.config.shape.vocab_size)
        asked = targets if targets is not None else torch.zeros(P - 1, 0, dtype=torch.long)
        chosen, top_ids, top_lps = [torch.zeros(0)], [asked.new_zeros(0, k)], [torch.zeros(0, k)]
        picked = [torch.zeros(0, asked.shape[1])]  # the empty pieces keep a one-token prompt's shapes
        for i in range(0, P - 1, chunk):
            # temperature: log_softmax(logits / T), the distribution the engine samples from (Engine.score_tokens)
            logprobs = torch.log_softmax(self._logits(hidden[i : i + chunk]) / temperature, dim=-1)
            chosen.append(logprobs.gather(-1, prompt[i : i + chunk, None])[:, 0])
            best = logprobs.topk(k)
            top_ids.append(best.indices)
            top_lps.append(best.values)
            rows = asked[i : i + chunk]
            picked.append(torch.where(rows >= 0, logprobs.gather(-1, rows.clamp(min=0)), 0.0))
        return PromptScores(torch.cat(chosen), torch.cat(top_ids), torch.cat(top_lps), torch.cat(picked))

    @torch.inference_mode()
    def packed_logprobs(self, token_ids: Tensor, positions: Tensor, place: Tensor, mask: Tensor, predictors: Tensor,
                        targets: Tensor, temperature: float = 1.0, chunk: int = 512, keys: Tensor | None = None) -> Tensor:
        """Several sequences in one forward, no KV cache (rollwise.engine.reference.scoring lays them out): token t
        (token_ids, positions: [T]) sits at flat index place[t] of a [rows, W] layout whose mask [rows, 1, W, Wk]
        says what each attends to; the matmuls run on the T real tokens, attention on the rows. Keys are the same
        layout (Wk = W), or `keys` [rows, Wk]: the token (index into T, -1: none) at each key slot, so one token's
        K/V can sit in several rows (a shared prompt computed once, seen by each of its continuations' rows).
        Returns fp32 log_softmax(logits / temperature) of targets[j] after token predictors[j] ([N]), the LM head a
        chunk at a time."""
        rows, width = mask.shape[0], mask.shape[-2]

        def lay_out(x: Tensor) -> Tensor:  # [T, heads, D] -> [rows, heads, W, D], zeros in the padding
            out = x.new_zeros(rows * width, *x.shape[1:])
            out[place] = x
            return out.view(rows, width, *x.shape[1:]).transpose(1, 2)

        def key_layout(x: Tensor) -> Tensor:  # [T, heads, D] -> [rows, heads, Wk, D]; index -1 picks the zero row
            if keys is None:
                return lay_out(x)
            padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
            return padded[keys.reshape(-1)].view(rows, keys.shape[1], *x.shape[1:]).transpose(1, 2)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            out = F.scaled_dot_product_attention(lay_out(q), key_layout(k), key_layout(v), attn_mask=mask,
                                                 enable_gqa=True)
            return out.transpose(1, 2).reshape(rows * width, -1)[place]

        hidden = self._hidden(token_ids, positions, attend)[predictors]
        return torch.cat([torch.log_softmax(self._logits(hidden[i : i + chunk]) / temperature, dim=-1)
                          .gather(-1, targets[i : i + chunk, None])[:, 0] for i in range(0, len(targets), chunk)])

    @torch.inference_mode()
    def decode(self, cache: KVCache, token_ids: Tensor, slots: list[int]) -> Tensor:
        """One token for each slot (each at its own position = its current length); returns fp32
        logits [batch, vocab]. `slots` should be ascending: a contiguous run is attended without a copy."""
        B = len(slots)
        positions = torch.tensor([cache.lengths[s] for s in slots])
        T = int(positions.max()) + 1
        slot_idx = torch.tensor(slots)
        # Each slot sees its own filled prefix plus the token being written now.
        mask = (torch.arange(T)[None, :] <= positions[:, None]).view(B, 1, 1, T)
        contiguous = slots[-1] - slots[0] + 1 == B
        group = self.config.shape.num_heads // self.config.shape.num_kv_heads

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k_cache, v_cache = cache.k[layer], cache.v[layer]
            k_cache[slot_idx, :, positions] = k
            v_cache[slot_idx, :, positions] = v
            if contiguous:
                keys, values = k_cache[slots[0] : slots[0] + B, :, :T], v_cache[slots[0] : slots[0] + B, :, :T]
            else:
                keys, values = k_cache[:, :, :T].index_select(0, slot_idx), v_cache[:, :, :T].index_select(0, slot_idx)
            # GQA without repeating K/V: the query heads sharing a KV head ride in SDPA's
            # query-length dimension (q heads h = kv * group + g, as HF's repeat_kv orders them).
            out = F.scaled_dot_product_attention(q.view(B, -1, group, q.shape[-1]), keys, values, attn_mask=mask)
            return out.reshape(B, -1)

        hidden = self._hidden(token_ids, positions, attend)
        for slot in slots:
            cache.lengths[slot] += 1
        return self._logits(hidden)

    @torch.inference_mode()
    def extend(self, cache: KVCache, chunks: list[list[int]], slots: list[int]) -> Tensor:
        """Several tokens for each slot in one forward (speculative verification): chunk i's tokens go
        at positions lengths[slot_i], lengths[slot_i] + 1, ...; each token attends to its slot's filled
        prefix and the chunk's tokens up to itself. Returns fp32 logits [sum of chunk lengths, vocab],
        chunk after chunk. The cache lengths grow by each chunk's length; a caller that rejects some
        of them rolls back by lowering `cache.lengths[slot]` (positions past a length are masked out
        and overwritten later, so nothing else needs undoing)."""
        B = len(slots)
        starts = torch.tensor([cache.lengths[s] for s in slots])
        sizes = torch.tensor([len(c) for c in chunks])
        Tq = int(sizes.max())
        if int((starts + sizes).max()) > cache.max_len:
            raise ValueError(f"extend past the cache's {cache.max_len} positions")
        offsets = torch.arange(Tq)
        valid = offsets[None, :] < sizes[:, None]  # [B, Tq]: which padded query rows are real tokens
        positions = (starts[:, None] + offsets[None, :])[valid]  # [N], chunk after chunk
        slot_of = torch.tensor(slots)[:, None].expand(B, Tq)[valid]  # [N]
        Tk = int((starts + sizes).max())
        # Query (b, q) sees key t when t <= start_b + q; padded rows see position 0 (no all-masked row).
        mask = (torch.arange(Tk)[None, None, :] <= (starts[:, None] + offsets[None, :])[:, :, None])
        mask = (mask & valid[:, :, None]) | (torch.arange(Tk) == 0)[None, None, :]
        mask = mask[:, None]  # [B, 1, Tq, Tk]
        slot_idx = torch.tensor(slots)

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k_cache, v_cache = cache.k[layer], cache.v[layer]
            k_cache[slot_of, :, positions] = k
            v_cache[slot_of, :, positions] = v
            keys = k_cache[:, :, :Tk].index_select(0, slot_idx)  # [B, KV, Tk, D]
            values = v_cache[:, :, :Tk].index_select(0, slot_idx)
            padded = q.new_zeros(B, Tq, *q.shape[1:])
            padded[valid] = q
            out = F.scaled_dot_product_attention(padded.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
            return out.transpose(1, 2)[valid].reshape(q.shape[0], -1)

        flat_tokens = torch.tensor([t for c in chunks for t in c])
        hidden = self._hidden(flat_tokens, positions, attend)
        for slot, size in zip(slots, sizes.tolist()):
            cache.lengths[slot] += size
        return self._logits(hidden)
