"""An OpenEnv arithmetic environment (reset / step / state over HTTP and WebSocket); see README.md."""

from arith_env.env import ArithAction, ArithEnvironment, ArithObservation, ArithState

__all__ = ["ArithAction", "ArithEnvironment", "ArithObservation", "ArithState"]
