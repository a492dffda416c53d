"""A cross-request prefix cache for the reference engine: token blocks -> their KV tensors.

GRPO groups share a prompt and multi-turn sessions share their history, so a new request often
starts with tokens whose keys and values some earlier request already computed. This cache keeps
those KV tensors in fixed-size token blocks (like vLLM's automatic prefix caching): a block is
identified by its tokens *and* its parent block, so a block is only ever reused after exactly the
same preceding tokens. Lookups walk the prompt block by block and stop at the first miss.

- Bounded by a token budget; least-recently-used leaf blocks are evicted first (a block with cached
  children is kept, so every cached chain stays reachable from the root).
- KV depends on the weights: the engine clears the cache on every weight update and inserts only
  sequences sampled entirely by the current policy version.
- At least one prompt token is always recomputed, because the logits of the last prompt token are
  needed to sample the first new token.
- A request's cache salt (vLLM's `cache_salt`) is the root of its chains: requests with different salts
  never share a block (the salt is the first block's parent, as vLLM mixes it into the first block's hash).

Exactness: a cached prefix makes the engine attend over the same keys and values a full prefill
would compute; only floating-point summation order differs (the suffix is a shorter matmul), which
is ~1e-7 in fp32. Tests check sampled tokens are identical and logprobs equal to 1e-5.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_BLOCK_SIZE = 16


@dataclass(eq=False)
class _Block:
    key: tuple[int | str, tuple[int, ...]]  # (parent block id, or the salt for a first block; this block's tokens)
    id: int
    parent: _Block | None
    k: Tensor  # [num_layers, num_kv_heads, block_size, head_dim]
    v: Tensor
    children: int = 0
    routing: Tensor | None = None  # MoE: the experts of the block's tokens [block_size, num_layers, top_k]


@dataclass
class PrefixHit:
    """The cached KV of a prompt's first `num_tokens` tokens, [num_layers, num_kv_heads, num_tokens, head_dim]."""

    num_tokens: int
    blocks: list[_Block] = field(repr=False)

    def kv(self) -> tuple[Tensor, Tensor]:
        return torch.cat([b.k for b in self.blocks], dim=2), torch.cat([b.v for b in self.blocks], dim=2)

    def routing(self) -> Tensor:
        """MoE: the cached prefix's experts [num_tokens, num_layers, top_k] (a hit skips the MoE layers)."""
        if any(b.routing is None for b in self.blocks):
            raise RuntimeError("a cached prefix block has no routing record (inserted without routing)")
        return torch.cat([b.routing for b in self.blocks])


class PrefixCache:
    """LRU over KV blocks of `block_size` tokens, holding at most `max_tokens` tokens."""

    def __init__(self, max_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_tokens < block_size:
            raise ValueError(f"max_tokens ({max_tokens}) must hold at least one block of {block_size} tokens")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self._blocks: OrderedDict[tuple[int | str, tuple[int, ...]], _Block] = OrderedDict()  # LRU order: oldest first
        self._next_id = 1  # 0 is the root

    @property
    def num_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def clear(self) -> None:
        self._blocks.clear()

    def match(self, prompt: Sequence[int], salt: str | None = None) -> PrefixHit | None:
        """The longest cached block chain under `salt` that is a prefix of prompt[:-1] (None when nothing matches)."""
        bs = self.block_size
        blocks: list[_Block] = []
        parent_id: int | str = _root(salt)
        for start in range(0, len(prompt) - 1 - bs + 1, bs):
            block = self._blocks.get((parent_id, tuple(prompt[start : start + bs])))
            if block is None:
                break
            blocks.append(block)
            parent_id = block.id
        for block in blocks:  # root to leaf: a parent is never younger than its children
            self._blocks.move_to_end(block.key)
        return PrefixHit(len(blocks) * bs, blocks) if blocks else None

    def insert(self, tokens: Sequence[int], k_slot: Tensor, v_slot: Tensor, routing: Tensor | None = None,
               salt: str | None = None) -> int:
        """Cache the full blocks of `tokens`, whose KV sits at positions [0, len(tokens)) of one KV-cache
        slot (k_slot, v_slot: [num_layers, num_kv_heads, max_len, head_dim]). Returns blocks added.
        MoE: `routing` [len(tokens), num_layers, top_k] is kept with the blocks."""
        bs = self.block_size
        parent: _Block | None = None
        added = 0
        for start in range(0, len(tokens) - bs + 1, bs):
            key = (parent.id if parent else _root(salt), tuple(tokens[start : start + bs]))
            block = self._blocks.get(key)
            if block is None:
                block = _Block(key, self._next_id, parent, k_slot[:, :, start : start + bs].clone(),
                               v_slot[:, :, start : start + bs].clone(),
                               routing=None if routing is None else routing[start : start + bs].clone())
                self._next_id += 1
                self._blocks[key] = block
                if parent is not None:
                    parent.children += 1
                added += 1
            else:
                self._blocks.move_to_end(key)
            parent = block
        self._evict()
        return added

    def _evict(self) -> None:
        while self.num_tokens > self.max_tokens:
            victim = next((b for b in self._blocks.values() if b.children == 0), None)
            if victim is None:  # unreachable: a chain always ends in a leaf
                return
            del self._blocks[victim.key]
            if victim.parent is not None:
                victim.parent.children -= 1


def _root(salt: str | None) -> int | str:
    """The parent key of a chain's first block: 0 unsalted, else the salt (block ids are ints: never equal)."""
    return 0 if salt is None else salt


@torch.inference_mode()
def prefill_with_prefix(model, cache, token_ids: list[int], slots: list[int], hit: PrefixHit) -> Tensor:
    """LlamaFamilyModel.prefill, but the first hit.num_tokens positions come from the prefix cache:
    only the suffix is run through the model, attending over cached + new keys. Same contract:
    KV for the whole prompt lands in every slot, returns fp32 logits [vocab] for the next token."""
    C, first = hit.num_tokens, slots[0]
    prefix_k, prefix_v = hit.kv()
    cache.k[:, first, :, :C] = prefix_k
    cache.v[:, first, :, :C] = prefix_v
    return prefill_suffix(model, cache, token_ids, slots, C)


@torch.inference_mode()
def prefill_suffix(model, cache, token_ids: list[int], slots: list[int], start: int) -> Tensor:
    """Prefill token_ids[start:] into slots[0], whose positions [0, start) already hold the KV of
    token_ids[:start] (from the prefix cache, a pinned or a swapped-in session); then as prefill."""
    C, P, first = start, len(token_ids), slots[0]
    # Suffix query i sits at position C + i and sees keys 0 .. C + i.
    mask = torch.ones(P - C, P, dtype=torch.bool).tril(diagonal=C)

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache.k[layer, first, :, C:P] = k.transpose(0, 1)
        cache.v[layer, first, :, C:P] = v.transpose(0, 1)
        keys, values = cache.k[layer, first, :, :P], cache.v[layer, first, :, :P]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1).reshape(P - C, -1)

    hidden = model._hidden(torch.tensor(token_ids[C:]), torch.arange(C, P), attend)
    cache.share_prefix(slots, P)
    return model._logits(hidden[-1])
