"""Rewards: per-response scoring (rollwise.reward.scoring) with the strict answer format
(rollwise.tasks.answer_format, shared with the prompts that state it), batches of them (batch), a pool
of scorer processes (pool), the pool as the training loop's Scorer (pool_scorer, with the task's own verifier as a
pool function in task_reward), code execution in a sandbox (code_exec) and pluggable verifiers (verifiers)."""
