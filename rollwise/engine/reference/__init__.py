"""The reference engine: a small, exact, pure-PyTorch continuous-batching engine (the CPU default
and the oracle for engine-mismatch checks). `ReferenceEngine` is rollwise.engine.reference.engine's;
its scheduler is in scheduler; the components it holds are in lora, session_retention, migration and speculative."""
