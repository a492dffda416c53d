"""`Engine.score_tokens` on vLLM: a one-token request with `prompt_logprobs=0` over the ids, run to its end, each
position's log-prob of its own token read from vLLM's prompt logprobs.

vLLM 0.32 computes prompt logprobs from the raw logits (its gpu_model_runner: "prompt tokens skip sampling
processors"), so they are at temperature 1 whatever the request's temperature: another temperature is refused
here rather than answered wrong. The engine must be idle (this steps vLLM to the request's end, and a step would
also advance, and here drop, other requests' tokens)."""

from __future__ import annotations

from typing import Any

from rollwise.engine.scoring import check_score_request


class VllmScoring:
    """Mixed into VLLMEngine (which holds these attributes)."""

    _llm: Any  # vllm LLMEngine
    max_model_len: int
    vocab_size: int

    def score_tokens(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i in start..len-1 (rollwise.engine.scoring), temperature 1 only."""
        check_score_request(token_ids, start, temperature, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if temperature != 1.0:
            raise ValueError(f"score: temperature={temperature}: vLLM's prompt logprobs are the raw model's "
                             "(temperature 1); score at temperature 1, or use the reference engine")
        if self._llm.has_unfinished_requests():
            raise RuntimeError("score_tokens needs an idle vLLM engine: drain or abort the streaming requests first")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rid = f"score-{id(token_ids)}-{len(token_ids)}"
        self._llm.add_request(rid, TokensPrompt(prompt_token_ids=list(token_ids)),
                              SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False))
        while True:
            for out in self._llm.step():
                if out.request_id == rid and out.finished:
                    scores = out.prompt_logprobs  # position 0: None; i: {token_ids[i]: Logprob, ...}
                    return [float(scores[i][token_ids[i]].logprob) for i in range(start, len(token_ids))]
