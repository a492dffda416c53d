"""Prompt token ids for routing: the router tokenizes exactly as the engines do, so the prefixes it
tracks are the engines' cached prefixes. Routing only: the request body goes to the engine
untouched, and the engine tokenizes it itself.

Only the first `max_chars` characters of a prompt are tokenized: routing needs its start (the cached
prefix), and a multi-megabyte prompt must not cost the router seconds. A cut text's last token may differ
from the whole text's, so it is dropped: what is returned stays a prefix of the engine's tokens.

Without a tokenizer (the replicas' model cannot be loaded here), prompts are routed by their UTF-8
bytes: shared text prefixes are still shared byte prefixes, so prefix routing keeps working,
only token counts (load costs) become byte counts.
"""

from __future__ import annotations

import json
from typing import Any

from rollwise.model.template_ids import flat_token_ids


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a model spec (tiny:SEED, bundled:NAME or a local HF directory), without its weights."""
    from rollwise.model.loading import TINY_MOE_PREFIX, TINY_PREFIX, resolve_model_path

    if spec.startswith((TINY_PREFIX, TINY_MOE_PREFIX)):
        from rollwise.model.tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))


def _ids(value: Any) -> bool:
    # Exact ints only (a JSON true is a bool, never a token id); set(map(type, ...)) runs in C: a 500-token
    # prompt costs a few microseconds instead of ~40 in a Python-level loop, on every request.
    return isinstance(value, list) and set(map(type, value)) <= {int}


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    # The same call as the engine's encode_prompt (rollwise.tasks.prompts), without importing the task stack.
    return flat_token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def prompt_tokens(endpoint: str, body: dict[str, Any], tokenizer: Any | None, max_chars: int = 65536) -> list[int]:
    """Best effort: [] when the body is not well formed (the engine will name the problem)."""
    try:
        if endpoint in ("/generate", "/inference/v1/generate"):  # rollwise's and vLLM's token-in routes
            ids = body.get("prompt_ids" if endpoint == "/generate" else "token_ids")
            return ids[:max_chars] if _ids(ids) else []  # a slice is a new list already
        if endpoint == "/v1/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and not _ids(prompt):
                prompt = prompt[0]  # several prompts in one request: route by the first
            if _ids(prompt):
                return list(prompt[:max_chars])
            if isinstance(prompt, str):
                return _text_ids(tokenizer, prompt, max_chars)
            return []
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        flat, cut = _bounded_messages(messages, max_chars)
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            ids = _chat_ids(tokenizer, flat)
            return ids[:-1] if cut else ids
        return list(json.dumps(flat).encode())[:-1]  # without the closing bracket: a prefix of the next turn
    except Exception:  # noqa: BLE001 - malformed input: no tokens, the engine answers with the error
        return []


def _text_ids(tokenizer: Any | None, text: str, max_chars: int) -> list[int]:
    cut = len(text) > max_chars
    text = text[:max_chars]
    ids = tokenizer.encode(text) if tokenizer is not None else list(text.encode())
    return ids[:-1] if cut else ids


def _bounded_messages(messages: list[Any], max_chars: int) -> tuple[list[dict[str, str]], bool]:
    """The conversation's first `max_chars` characters of content; True when some were cut."""
    flat, left = [], max_chars
    for m in messages:
        content = _text(m["content"])
        flat.append({"role": m["role"], "content": content[:left]})
        if len(content) > left:
            return flat, True
        left -= len(content)
    return flat, False


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
