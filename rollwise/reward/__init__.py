"""Rewards: per-response scoring (rollwise.reward.scoring) with the strict answer format
(rollwise.tasks.answer_format, shared with the prompts that state it), batches of them (batch), a pool
of scorer processes (pool), code execution in a sandbox (code_exec) and pluggable verifiers (verifiers)."""
