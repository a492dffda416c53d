"""OpenAI response shapes for the engine server: choices, stream deltas, logprobs, echo, usage, SSE lines.

Every choice also carries rollwise's fields: token_ids (exactly the sampled ids), prompt_token_ids,
policy_versions (one per token) and cached_prompt_tokens.
"""

from __future__ import annotations

from typing import Any

from rollwise.engine.samples import Detokenizer, Sample
from rollwise.serve.openai_schemas import CompletionRequest
from rollwise.serve.responses import FiniteJSONResponse


def sse(payload: dict[str, Any] | str) -> str:
    if not isinstance(payload, str):  # like FiniteJSONResponse: never NaN/Infinity, which JSON does not have
        payload = FiniteJSONResponse(payload).body.decode("utf-8")
    return f"data: {payload}\n\n"


class OpenAIResponses:
    """Shapes samples into OpenAI's layouts; `detok` gives each token's text."""

    def __init__(self, detok: Detokenizer) -> None:
        self.detok = detok

    def logprobs(self, chat: bool, s: Sample, start: int, end: int) -> dict[str, Any]:
        pieces = [self.detok.piece(t) for t in s.token_ids[start:end]]
        tops = s.top_logprobs[start:end] if s.top_logprobs else [[] for _ in pieces]
        if chat:  # OpenAI: top_logprobs is a list of {token, logprob, bytes}, best first
            return {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode("utf-8")),
                 "top_logprobs": [self.logprob_entry(t, alt) for t, alt in top]}
                for p, lp, top in zip(pieces, s.logprobs[start:end], tops)
            ]}
        offset = sum(len(self.detok.piece(t)) for t in s.token_ids[:start])
        offsets = []
        for p in pieces:
            offsets.append(offset)
            offset += len(p)
        # Legacy completions: one {token text: logprob} per token, the best alternatives plus the
        # sampled token (as vLLM returns them); null when no alternatives were asked for.
        top_dicts = None
        if s.top_logprobs:
            top_dicts = [{**{self.detok.piece(t): alt for t, alt in top}, p: lp}
                         for p, lp, top in zip(pieces, s.logprobs[start:end], tops)]
        return {"tokens": pieces, "token_logprobs": s.logprobs[start:end], "top_logprobs": top_dicts,
                "text_offset": offsets}

    def logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        piece = self.detok.piece(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    def echo(self, result: dict[str, Any], body: CompletionRequest, prompts: list[list[int]]) -> None:
        """echo: each choice's text starts with its prompt (as sent, or decoded from ids); its logprobs
        start with the prompt tokens, whose logprobs are null (prompt logprobs are not computed here)."""
        n = body.n
        for choice in result["choices"]:
            p = choice["index"] // n
            sent = body.prompt[p]
            prompt_text = sent if isinstance(sent, str) else self.detok.decode(prompts[p])
            choice["text"] = prompt_text + choice["text"]
            lp = choice["logprobs"]
            pieces = [self.detok.piece(t) for t in prompts[p]]
            offsets = [sum(len(q) for q in pieces[:k]) for k in range(len(pieces))]
            shift = len(prompt_text)
            lp["text_offset"] = offsets + [o + shift for o in lp["text_offset"]]
            lp["tokens"] = pieces + lp["tokens"]
            lp["token_logprobs"] = [None] * len(pieces) + lp["token_logprobs"]
            if lp["top_logprobs"] is not None:
                lp["top_logprobs"] = [None] * len(pieces) + lp["top_logprobs"]

    def choice(self, chat: bool, s: Sample) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": s.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": s.text}
        else:
            choice["text"] = s.text
        choice.update(
            logprobs=self.logprobs(chat, s, 0, len(s.token_ids)),
            finish_reason=s.finish_reason,
            token_ids=s.token_ids,
            prompt_token_ids=s.prompt_ids,
            policy_versions=s.versions,
            cached_prompt_tokens=s.cached_prompt_tokens,
        )
        if s.routed_experts is not None:  # MoE: the experts of prompt + token_ids[:-1], for routing replay
            choice["routed_experts"] = s.routed_experts.to_wire()
        return choice

    @staticmethod
    def usage(prompts: list[list[int]], samples: list[Sample]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(s.token_ids) for s in samples)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def delta(self, chat: bool, s: Sample) -> dict[str, Any] | None:
        if s.closed:
            return None
        text, start, end = s.take_delta()
        closing = s.finished and s.engine_done
        if not text and start == end and not closing and s.announced:
            return None
        choice: dict[str, Any] = {"index": s.index}
        if chat:
            choice["delta"] = {"content": text} if text or not closing else {}
        else:
            choice["text"] = text
        choice.update(
            logprobs=self.logprobs(chat, s, start, end),
            finish_reason=s.finish_reason if closing else None,
            token_ids=s.token_ids[start:end],
            policy_versions=s.versions[start:end],
        )
        if not s.announced:
            s.announced = True
            choice["prompt_token_ids"] = s.prompt_ids
        if closing:
            s.closed = True
            choice["cached_prompt_tokens"] = s.cached_prompt_tokens
            if s.routed_experts is not None:
                choice["routed_experts"] = s.routed_experts.to_wire()
        return choice
