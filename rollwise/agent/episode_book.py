"""What every controller that runs whole episodes answers the training loop between steps (the agent layer's
AgentController, rollwise.environments' EnvController): one ledger slot per episode (episodes are never
regenerated, DESIGN invariant 3), the policy version, and the groups a resumed run still owes."""

from __future__ import annotations

from rollwise.agent.samples import assign_episode_advantages
from rollwise.types.ledger import RolloutLedger
from rollwise.types.sample import Sample


def episode_slot(episode_id: str) -> tuple[int, int]:
    """Ledger slot of a training episode: `g12-3` (group 12, episode 3) -> (12, 3)."""
    group, episode = episode_id.removeprefix("g").rsplit("-", 1)
    return int(group), int(episode)


class EpisodeBook:
    def __init__(self, *, policy_version: int, start_group: int, pending_groups: list[int] | None) -> None:
        self.version = policy_version
        self.ledger = RolloutLedger()
        self.next_group = start_group
        self.redo_groups = sorted(pending_groups or [])
        self.last_metrics: dict[str, float] = {}  # the last batch's, as step_metrics() reports them

    def next_group_index(self) -> int:
        """A group a resumed run still owes first, else the next new one."""
        if self.redo_groups:
            return self.redo_groups.pop(0)
        index = self.next_group
        self.next_group += 1
        return index

    def assign_advantages(self, samples: list[Sample], mode: str) -> float:
        return assign_episode_advantages(samples, mode)

    def step_metrics(self) -> dict[str, float]:
        return dict(self.last_metrics)

    def before_update(self) -> None:
        pass

    def mark_trained(self, samples: list[Sample]) -> None:
        for episode_id in dict.fromkeys(s.extra.get("episode_id", s.sample_id) for s in samples):
            self.ledger.move(episode_slot(episode_id), "trained")

    def after_update(self, version: int) -> None:
        self.version = version

    def pending_groups(self) -> list[int]:
        return list(self.redo_groups)

    def in_flight(self) -> int:
        return 0  # episodes run to the end inside next_batch
