"""`Engine.score_tokens` on the reference engine: the model's prompt-scoring forward (LlamaFamilyModel.
prompt_logprobs, the prefill's ops with no KV cache, fp32 log-softmax), under the base weights or the default
adapter, as a request without an adapter would sample."""

from __future__ import annotations

from rollwise.engine.reference.lora import AdapterSet
from rollwise.engine.reference.model import LlamaFamilyModel
from rollwise.engine.scoring import check_score_request


class ReferenceScoring:
    """Mixed into ReferenceEngine (which holds these attributes)."""

    model: LlamaFamilyModel
    adapters: AdapterSet
    max_model_len: int

    def score_tokens(self, token_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) at `temperature`, for i in start..len-1 (rollwise.engine.scoring)."""
        check_score_request(token_ids, start, temperature, max_model_len=self.max_model_len,
                            vocab_size=self.model.config.shape.vocab_size)
        with self.adapters.rows([self.adapters.resolve(None)]):
            scores = self.model.prompt_logprobs(token_ids, temperature=temperature)
        chosen = scores.chosen[start - 1:]
        if not bool(chosen.isfinite().all()):  # a token of probability 0 at a temperature near 0: JSON has no -inf
            raise ValueError(f"score: temperature={temperature} gives a token log-prob that is not finite (the token "
                             "has probability 0 at this temperature): score at a higher temperature")
        return chosen.tolist()
