"""What `tokenizer.apply_chat_template(..., tokenize=True)` returned, as one flat list of token ids.

transformers 5 returns a BatchEncoding (dict-like), older versions a list of ids, a backend asked for
tensors returns a tensor, and some templates a batch of one. The engine's prompts, the agent's turns and
the router's prefix keys all read it here, so the three always agree on a conversation's ids.
No torch or transformers import: the router process loads this without the model stack.
"""

from __future__ import annotations

from typing import Any


def flat_token_ids(out: Any) -> list[int]:
    if not isinstance(out, list) and hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # a tensor or array
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        if len(out) != 1:
            raise ValueError(f"expected one encoded conversation, got a batch of {len(out)}")
        out = out[0]
    return [int(t) for t in out]
