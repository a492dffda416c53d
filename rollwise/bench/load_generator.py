"""A closed-loop HTTP load generator on aiohttp, run in a process of its own.

`python -m rollwise.bench.load_generator --url URL --concurrency C --requests N ...` keeps C token-in requests
in flight (each worker sends its next one when its last is answered) until N were answered, and prints one JSON
object: every request's latency, the wall time, its own CPU seconds, and the errors. Its own process so the
client's CPU (HTTP, JSON) is not the server's it measures, and aiohttp (a C HTTP parser) so that the client eats
as little of the cores the server shares as a Python client can. `rollwise bench router`'s replica arm uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import aiohttp


def body(route: str, prompt: list[int], max_tokens: int, seed: int) -> dict[str, Any]:
    """The request for `route`: rollwise's /generate or vLLM's token-in /inference/v1/generate."""
    params = {"max_tokens": max_tokens, "ignore_eos": True, "seed": seed}
    if route == "/generate":
        return {"prompt_ids": prompt, **params}
    return {"token_ids": prompt, "sampling_params": params}


async def run_load(url: str, route: str, concurrency: int, requests: int, prompt_tokens: int, max_tokens: int,
                   vocab: int, seed: int = 0) -> dict[str, Any]:
    """`requests` requests, `concurrency` at a time, each with its own random prompt (no prefix-cache hits)."""
    rng = random.Random(seed)
    bodies = [json.dumps(body(route, [rng.randrange(5, vocab) for _ in range(prompt_tokens)], max_tokens, seed + i))
              for i in range(requests)]
    latencies: list[float] = []
    errors: list[str] = []
    left = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                     headers={"Content-Type": "application/json"}) as http:

        async def worker() -> None:
            for i in left:
                started = time.perf_counter()
                async with http.post(route, data=bodies[i]) as response:
                    payload = await response.read()
                    if response.status != 200:
                        errors.append(f"{response.status}: {payload[:200].decode(errors='replace')}")
                        continue
                latencies.append(time.perf_counter() - started)

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"concurrency": concurrency, "requests": requests, "latencies_s": latencies, "wall_s": wall,
            "client_cpu_s": cpu, "errors": errors}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--route", default="/generate", choices=["/generate", "/inference/v1/generate"])
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--vocab", type=int, default=100, help="prompt ids are drawn from [5, vocab)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.concurrency < 1 or a.requests < 1:
        p.error("--concurrency and --requests must be at least 1")
    result = asyncio.run(run_load(a.url, a.route, a.concurrency, a.requests, a.prompt_tokens, a.max_tokens,
                                  a.vocab, a.seed))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
