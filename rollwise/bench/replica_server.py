"""One engine server for `rollwise bench router`'s replica arm, which times the engine's own CPU.

Run by path (`python .../replica_server.py --port P --model-size JSON`), not as a module, so that with
`PYTHONPATH=<another checkout>` it serves that checkout's engine server (a `git worktree` of an older commit: the
"before" figure, measured in the same run). It imports only what every version has: the engine server's
`create_app`, the reference engine and the tiny model. The engine is the bench replica's (router_processes.py);
each step's CPU seconds (its thread's clock) are added up and answered on GET /bench/engine_cpu, so the arm can
subtract the bare engine's work from the process's CPU: what is left is the server's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def timed_app(model_size: dict[str, int], max_num_seqs: int, max_model_len: int, prefix_cache_tokens: int):  # noqa: ANN201
    """The bench replica's engine server app (one torch thread), its engine steps' CPU on GET /bench/engine_cpu."""
    import torch

    from rollwise.engine.reference.engine import ReferenceEngine
    from rollwise.engine.server import create_app
    from rollwise.model.tiny import tiny_llama, tiny_tokenizer

    class TimedEngine(ReferenceEngine):
        """The reference engine, its steps' CPU seconds counted (torch runs on the stepping thread: 1 thread)."""

        step_cpu_s = 0.0
        steps = 0

        def step(self):  # noqa: ANN202 - the engine's own return type
            started = time.thread_time()
            try:
                return super().step()
            finally:
                self.step_cpu_s += time.thread_time() - started
                self.steps += 1

    torch.set_num_threads(1)  # several replicas share the machine's cores
    tokenizer = tiny_tokenizer()
    model = tiny_llama(seed=0, max_position_embeddings=max_model_len, **model_size)
    engine = TimedEngine(model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         eos_token_ids=[tokenizer.eos_token_id], seed=0, prefix_cache_tokens=prefix_cache_tokens)
    app = create_app(engine, tokenizer, "bench-replica")

    @app.get("/bench/engine_cpu")
    async def engine_cpu() -> dict[str, float]:
        return {"step_cpu_s": engine.step_cpu_s, "steps": engine.steps}

    return app


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model-size", required=True, help="tiny_llama's size arguments, as JSON")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--prefix-cache-tokens", type=int, default=16384)
    args = p.parse_args(argv)
    import uvicorn

    app = timed_app(json.loads(args.model_size), args.max_num_seqs, args.max_model_len, args.prefix_cache_tokens)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # not this folder's modules as top-level
    main(sys.argv[1:])
