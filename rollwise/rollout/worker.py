"""Moved: the engine worker is the engine core, rollwise.engine.core.EngineWorker.

Re-exported here because the agent layer, the engine server, the pool server and the benchmarks
still import it from this path.
"""

from rollwise.engine.core import EngineWorker

__all__ = ["EngineWorker"]
