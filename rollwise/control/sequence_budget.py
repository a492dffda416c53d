"""The longest sequence a run asks its engine for: what the engine's KV cache is sized by (issue 41 item 7).

engine.max_model_len is the most an engine takes, usually far more than a run uses: the default run's prompts are
61-63 tokens and its budget 48, against a max_model_len of 512. vLLM on CPU allocates (and the run keeps resident)
KV for max_num_seqs sequences of the length it is given (rollwise.engine.vllm_startup.kv_cache_blocks_for_run), so
it is given this instead: 0.18 GiB for the default run where max_model_len's took 0.70 GiB.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from rollwise.config import RunConfig
from rollwise.rollout.sync_rollout import PromptEncoder
from rollwise.tasks import ENVIRONMENT_KINDS
from rollwise.types.task import Problem


def run_sequence_tokens(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, problems: Iterable[Problem]) -> int | None:
    """The run's longest prompt (train and held-out problems, through the chat template with the few-shot
    examples, as the rollout encodes them) + its largest generation budget (rollout.max_tokens, eval.max_tokens),
    at most engine.max_model_len. None where sequences grow beyond a prompt and one generation (agent runs and
    environment tasks: several turns) or drafts need room (engine.speculation), or there are no problems: then
    max_model_len sizes the cache, as before."""
    if cfg.agent is not None or cfg.task.kind in ENVIRONMENT_KINDS or cfg.engine.speculation != "none":
        return None
    encoder = PromptEncoder(tokenizer, cfg.prompt, cfg.reward)
    longest = max((len(encoder(problem)) for problem in problems), default=None)
    if longest is None:
        return None
    budget = max(cfg.rollout.max_tokens, cfg.eval.max_tokens or cfg.rollout.max_tokens)
    return min(cfg.engine.max_model_len, longest + budget)
