"""Speculative decoding from the policy's own rollout history (issue 19, DAS).

- history.HistoryDrafter: per-problem and global suffix counts over recent rollouts; proposes drafts.
- budget.draft_budget: the pure, length-aware draft length (the simulator can use it).
- drafter.Drafter: what an engine asks of a drafter; drafter.drafter_for: the one an engine section asks for.
- the reference engine verifies drafts exactly (rollwise/engine/reference/sampling.py: verify_draft_token).
"""
