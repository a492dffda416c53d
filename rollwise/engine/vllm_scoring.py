"""`Engine.score_tokens` on vLLM: a one-token request with `prompt_logprobs=0` over each sequence's ids, the batch's
requests queued together and run to their end, each position's log-prob of its own token read from vLLM's prompt
logprobs.

vLLM 0.32 computes prompt logprobs from the raw logits (its gpu_model_runner: "prompt tokens skip sampling
processors"), so they are at temperature 1 whatever the request's temperature: another temperature is refused
here rather than answered wrong. The engine must be idle (this steps vLLM to the request's end, and a step would
also advance, and here drop, other requests' tokens)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollwise.engine.scoring import check_score_request
from rollwise.types.score import ScoreSequence

if TYPE_CHECKING:  # an annotation only: the engine imports vLLM
    from vllm.v1.engine.llm_engine import LLMEngine


class VllmScoring:
    """Mixed into VLLMEngine (which holds these attributes)."""

    _llm: LLMEngine
    max_model_len: int
    vocab_size: int

    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]:
        """Per sequence, log p(token_ids[i] | token_ids[:i]) for i in start..len-1 (rollwise.engine.scoring),
        temperature 1 only: every sequence a request, all queued at once, so vLLM's scheduler batches them."""
        check_score_request(sequences, temperature, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        if temperature != 1.0:
            raise ValueError(f"score: temperature={temperature}: vLLM's prompt logprobs are the raw model's "
                             "(temperature 1); score at temperature 1, or use the reference engine")
        if self._llm.has_unfinished_requests():
            raise RuntimeError("score_tokens needs an idle vLLM engine: drain or abort the streaming requests first")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        batch = f"score-{uuid.uuid4().hex}"
        for i, seq in enumerate(sequences):
            self._llm.add_request(f"{batch}-{i}", TokensPrompt(prompt_token_ids=list(seq.token_ids)), params)
        out: dict[int, list[float]] = {}
        while len(out) < len(sequences):
            for done in self._llm.step():
                if done.finished and done.request_id.startswith(f"{batch}-"):
                    i = int(done.request_id.rsplit("-", 1)[1])
                    ids, scores = sequences[i].token_ids, done.prompt_logprobs  # position 0: None; j: {ids[j]: ...}
                    out[i] = [float(scores[j][ids[j]].logprob) for j in range(sequences[i].start, len(ids))]
        return [out[i] for i in range(len(sequences))]
