"""A verifiers 0.4 (v1) environment package written as a third party would: it imports verifiers, never rollwise.

`EchoTaskset` builds its tasks from synthetic data (no hub download): "Say the word: <word>", rewarded 1.0
when the final answer contains the word. `EchoHarness` is the taskset's default harness: a two-turn chat loop
run in-process (verifiers' Harness contract allows it: every model call goes through the interception
endpoint), so a rollout needs neither `uv` nor a network, unlike the built-in harnesses, which `uv sync`
their PEP 723 scripts from PyPI when a rollout starts. Turn 2 appends "Say it again." to turn 1's
conversation, so the train client continues turn 1's exact tokens (TITO).
"""

from verifiers_v1_echo.harness import EchoHarness
from verifiers_v1_echo.taskset import EchoTaskset

__all__ = ["EchoTaskset", "EchoHarness"]
