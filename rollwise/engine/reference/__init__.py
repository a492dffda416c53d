"""The reference engine: a small, exact, pure-PyTorch continuous-batching engine (the CPU default
and the oracle for engine-mismatch checks)."""

from rollwise.engine.reference.engine import ReferenceEngine

__all__ = ["ReferenceEngine"]
