"""The reference engine's prefix cache, as the intercept simulator counts it (rollwise.engine.reference.
prefix_cache is the real one): an LRU over KV blocks of `block_size` tokens, at most `max_tokens`.

What it holds, as the engine fills it: every prefill's prompt (a running sequence's prompt too: the cache
keeps copies beside the slots) and every finished turn's history (prompt + tokens but the last). A
session's blocks form one chain, touched root to leaf at once, so the engine's eviction (the least
recently used block without children) cuts the least recently used chain from its tail, block by block.
A lookup uses whole blocks of prompt[:-1] (the last prompt token is always computed).

Sessions never share a block here (their prompts differ from the first token), so one entry per session,
the number of leading tokens whose blocks are cached, is the whole state.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPrefixCache:
    def __init__(self, max_tokens: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.cached: OrderedDict[int, int] = OrderedDict()  # session -> cached leading tokens, LRU first

    @property
    def num_tokens(self) -> int:
        return sum(self.cached.values())

    def insert(self, session: int, tokens: int) -> None:
        """The session's first `tokens` tokens have KV now (a prefill's prompt, a finished history)."""
        full = tokens // self.block_size * self.block_size
        self.cached[session] = max(full, self.cached.get(session, 0))
        self.cached.move_to_end(session)
        self._evict()

    def match(self, session: int, prompt_tokens: int) -> int:
        """Leading prompt tokens whose KV a prefill of `prompt_tokens` tokens finds cached (touches them)."""
        if session not in self.cached:
            return 0
        usable = (prompt_tokens - 1) // self.block_size * self.block_size
        self.cached.move_to_end(session)
        return min(self.cached[session], usable)

    def _evict(self) -> None:
        excess = self.num_tokens - self.max_tokens
        while excess > 0 and self.cached:
            session, tokens = next(iter(self.cached.items()))
            blocks = min(tokens, -(-excess // self.block_size) * self.block_size)  # whole blocks, tail first
            excess -= blocks
            if blocks == tokens:
                del self.cached[session]
            else:
                self.cached[session] = tokens - blocks
