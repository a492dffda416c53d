"""`rollwise bench intercept`: agentic rollouts that stop at tool calls, on a reference engine whose KV
slots are under pressure, under each session-retention policy (issue 21, InferCept); with `--engine vllm`
(or both) also on vLLM, whose KV cache is cut to the same memory in blocks.

Workload (the same in every arm, seeded): `sessions` episodes, `concurrency` of them in flight on one
engine with fewer KV slots than sessions. Each episode has `turns` engine turns; between two turns a
tool runs for real, chosen in turn: the calculator (rollwise.agent.tools, microseconds), the python tool
in a LocalSandbox (a real subprocess), or a wait drawn from a long-tailed lognormal distribution (tools
such as search or a slow test suite). The tool's result comes back as `tool_tokens` fixed tokens; turns
decode `output_tokens` with ignore_eos. Every turn goes through the agent's LocalGenerator: generate, then
retain(session, request, tool, expected latency learned per tool from the measured durations), exactly
as rollwise.agent.episode does; the episode's end releases the session.

Arms: min_waste (with a swap tier), always_discard (no prefix cache), always_preserve and
prefix_cache_only (an LRU prefix cache as large as the pin budget, so both hold the same memory).
Reported per arm: episodes/s, recomputed prompt tokens / prompt tokens, memory x time waste (pinned
slot-seconds x slot tokens while held, plus recomputed tokens x the engine's measured prefill time per
token x the KV of the batch it stalled: an estimate from the engine's counters), p50/p99 turn latency,
and the held KV admission took for waiting requests (demoted to the swap tier, or dropped).
Goals (issue 21): min_waste >= 1.5x the episodes/s of always_discard and >= 1.2x prefix_cache_only;
recomputed <= 10% of prompt tokens. `rollwise sim intercept --from-bench JSON` replays the workload
with the costs measured here (simulation_inputs) and compares medians.

On vLLM (rollwise.engine.vllm_retention) there is no swap tier and the prefix cache is always on, over every
free block, so prefix_cache_only runs with the same memory as the others; always_discard evicts the turn's
blocks. Recomputed tokens are counted from the client: each resumed turn's previous context (prompt + output,
less the last token, whose KV is never computed) minus the prompt tokens vLLM served from its cache.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from rich.console import Group
from rich.table import Table
from torch import nn

from rollwise.agent.generator import LocalGenerator
from rollwise.agent.tools import CalculatorTool, PythonTool
from rollwise.engine.reference.engine import ReferenceEngine
from rollwise.engine.retention import RetentionLimits, RetentionRequest
from rollwise.engine.retention_policy import ToolLatencies
from rollwise.types.generation import SamplingParams
from rollwise.sandbox.local import LocalSandbox

POLICIES = ("min_waste", "always_discard", "always_preserve", "prefix_cache_only")


@dataclass(frozen=True)
class Workload:
    sessions: int
    concurrency: int
    turns: int
    prompt_tokens: int
    tool_tokens: int
    output_tokens: int
    slots: int  # the engine's KV slots: fewer than concurrency, so memory is contended
    max_model_len: int
    slow_tool_median_s: float  # the long-tailed tool: lognormal(median, sigma=1), capped at 10x the median


# Turns decode few tokens over long contexts, so recomputing a context costs more than generating a turn.
QUICK = Workload(sessions=8, concurrency=6, turns=3, prompt_tokens=256, tool_tokens=16, output_tokens=8,
                 slots=4, max_model_len=384, slow_tool_median_s=0.2)
FULL = Workload(sessions=48, concurrency=12, turns=4, prompt_tokens=384, tool_tokens=32, output_tokens=24,
                slots=8, max_model_len=768, slow_tool_median_s=0.5)


class _Tools:
    """The three tools, each call timed (what the agent's ToolLatencies learns from)."""

    def __init__(self, work: Workload, seed: int) -> None:
        self.calculator = CalculatorTool()
        self.sandbox = LocalSandbox()
        self.python = PythonTool(self.sandbox)
        self.work = work
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def run(self, turn: int, session: int) -> tuple[str, float]:
        name = ("calculator", "python", "slow")[(turn + session) % 3]
        started = time.monotonic()
        if name == "calculator":
            self.calculator.run({"expression": f"({session} + {turn}) * 7"})
        elif name == "python":
            self.python.run({"code": f"print(sum(range({1000 * (session + 1)})))"})
        else:
            with self.lock:
                draw = self.rng.gauss(0.0, 1.0)
            median = self.work.slow_tool_median_s
            time.sleep(min(10 * median, median * math.exp(draw)))
        return name, time.monotonic() - started

    def close(self) -> None:
        self.sandbox.close()


def _engine(model: nn.Module, tokenizer: Any, work: Workload, policy: str, kind: str = "reference") -> Any:
    """The same KV memory in every arm: prefix_cache_only's cache (held outside the slots) is paid for with
    the slots the other arms may pin, so its engine runs that many fewer slots. On vLLM the KV cache is the
    slots' tokens in blocks (+ vLLM's null block), its prefix cache always on over the free ones."""
    capacity = work.slots * work.max_model_len
    pin_slots = work.slots // 2
    limits = RetentionLimits(pin_budget_tokens=pin_slots * work.max_model_len,
                             swap_budget_tokens=capacity * 4 if policy == "min_waste" else 0,
                             swap_bytes_per_s=8e9, ttl_max_s=60.0)
    if kind == "vllm":
        from rollwise.engine.vllm_backend import CPU_BLOCK_SIZE, VLLMEngine

        return VLLMEngine(model, tokenizer, max_num_seqs=work.slots, max_model_len=work.max_model_len, seed=0,
                          kv_cache_gib=1, kv_cache_blocks=capacity // CPU_BLOCK_SIZE + 1,
                          retention=replace(limits, swap_budget_tokens=0), retention_policy=policy)  # type: ignore[arg-type]
    cache_only = policy == "prefix_cache_only"
    return ReferenceEngine(model, max_num_seqs=work.slots - (pin_slots if cache_only else 0),
                           max_model_len=work.max_model_len,
                           eos_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None,
                           prefix_cache_tokens=pin_slots * work.max_model_len if cache_only else 0,
                           retention=limits, retention_policy=policy)  # type: ignore[arg-type]


def _episode(generator: LocalGenerator, tools: _Tools, latencies: ToolLatencies, work: Workload, index: int,
             seed: int, out: dict[str, list]) -> None:
    rng = random.Random(seed * 7919 + index)
    vocab = out["vocab"][0]
    low = min(100, vocab // 4)  # clear of special tokens
    prompt = [rng.randrange(low, vocab) for _ in range(work.prompt_tokens)]
    session = f"s{index}"
    params = SamplingParams(max_tokens=work.output_tokens, temperature=1.0, ignore_eos=True)
    computed = 0  # context tokens whose KV the engine computed for the previous turn
    for turn in range(work.turns):
        started = time.monotonic()
        completion = generator.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed + 100 * index + turn}),
                                        session_id=session)
        out["turn_s"].append(time.monotonic() - started)
        out["recomputed"].append(max(0, computed - completion.cached_prompt_tokens))
        computed = len(prompt) + len(completion.token_ids) - 1
        if turn == work.turns - 1:
            break
        tool = ("calculator", "python", "slow")[(turn + index) % 3]
        decision = generator.retain(RetentionRequest(session, completion.request_id, tool, latencies.expected(tool)))
        out["actions"].append(decision.action if decision is not None else "none")
        if decision is not None and decision.tokens == 0:  # its KV was gone before retain(): admission took it
            out["no_kv"].append(session)
        if decision is not None and decision.action == "preserve":
            out["pins"].append((time.monotonic(), decision.tokens))
        name, seconds = tools.run(turn, index)
        latencies.observe(name, seconds)
        out["tool_s"].append(seconds)
        prompt = prompt + completion.token_ids + [rng.randrange(low, vocab) for _ in range(work.tool_tokens)]
    generator.release_session(session)


def run_arm(model: nn.Module, tokenizer: Any, work: Workload, policy: str, seed: int,
            progress: Callable[[str], None] | None = None, kind: str = "reference") -> dict[str, Any]:
    engine = _engine(model, tokenizer, work, policy, kind)
    generator = LocalGenerator(engine)
    tools = _Tools(work, seed)
    latencies = ToolLatencies(default_s=work.slow_tool_median_s)
    out: dict[str, list] = {"turn_s": [], "actions": [], "pins": [], "tool_s": [], "no_kv": [], "recomputed": [],
                            "vocab": [model.config.vocab_size]}
    semaphore = threading.Semaphore(work.concurrency)
    errors: list[BaseException] = []
    done = [0]

    def one(i: int) -> None:
        with semaphore:
            try:
                _episode(generator, tools, latencies, work, i, seed, out)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, on the bench's thread
                errors.append(exc)
            done[0] += 1  # under the GIL; a progress line, not a count anything depends on
            if progress:
                progress(f"{policy}: {done[0]}/{work.sessions} episodes")

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(work.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    generator.close()
    tools.close()
    if errors:
        raise errors[0]
    stats = engine.stats
    steps_s = generator.worker.step_seconds
    held = engine.retention_stats()
    if kind == "vllm":  # counted by the client (see the module docstring); vLLM has no swap tier
        recomputed, swap_s_per_token = sum(out["recomputed"]), 0.0
        recompute_s_per_token = engine.session_pins.recompute_cost.s_per_token
        engine.close()
    else:
        recomputed, swap_s_per_token = stats["recomputed_prompt_tokens"], engine.kv_tiers.swap_cost.s_per_token
        recompute_s_per_token = engine.retention.recompute_cost.s_per_token
    prefilled = stats["prompt_tokens"] - stats["cached_prompt_tokens"]
    # Waste estimate (token-s): slots pinned while tools ran, and recomputation stalling the running batch
    # (half the slots busy on average, an assumption stated in the docs).
    pinned_waste = sum(1 for _ in out["pins"]) * statistics.fmean(out["tool_s"] or [0.0]) * work.max_model_len
    recompute_waste = recomputed * recompute_s_per_token * (work.slots / 2) * work.max_model_len
    return {
        "policy": policy,
        "engine": kind,
        "episodes": work.sessions,
        "wall_s": wall,
        "episodes_per_s": work.sessions / wall,
        "prompt_tokens": stats["prompt_tokens"],
        "recomputed_tokens": recomputed,
        "recomputed_fraction": recomputed / max(1, stats["prompt_tokens"]),
        "waste_token_s": pinned_waste + recompute_waste,
        "turn_latency_p50_s": _quantile(out["turn_s"], 0.5),
        "turn_latency_p99_s": _quantile(out["turn_s"], 0.99),
        "actions": {a: out["actions"].count(a) for a in sorted(set(out["actions"]))},
        # held KV admission took for waiting requests: moved to the swap tier, dropped (pins; parked turns,
        # which retain() then finds gone); and pins whose TTL ran out
        "taken_by_admission": {"demoted_to_swap": held.get("demoted", 0), "pins_dropped": held.get("released_evicted", 0),
                               "turns_dropped_before_retain": len(out["no_kv"]), "pins_expired": held.get("released_ttl", 0)},
        "retention": held,
        "engine_busy_s": steps_s,
        # decode time per step: the engine's busy time less its prefills (at the measured rate per token)
        "measured": {"prefill_s_per_token": recompute_s_per_token,
                     "decode_s_per_step": max(0.0, steps_s - prefilled * recompute_s_per_token) / max(1, stats["steps"]),
                     "swap_s_per_token": swap_s_per_token,
                     "tool_s_median": statistics.median(out["tool_s"]) if out["tool_s"] else 0.0},
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_intercept_bench(model: nn.Module, tokenizer: Any, *, quick: bool = False, seed: int = 0,
                        work: Workload | None = None, progress: Callable[[str], None] | None = None,
                        engines: tuple[str, ...] = ("reference",)) -> dict[str, Any]:
    """Every policy on the same work, per engine kind. The reference engine's result is the top level (what
    `rollwise sim intercept --from-bench` replays); vLLM's, when run, is under "vllm"."""
    work = work or (QUICK if quick else FULL)
    results = {kind: _engine_arms(model, tokenizer, work, seed, progress, kind) for kind in engines}
    first = results.pop("reference", None) or results.pop(engines[0])
    return {**first, **results}


def _engine_arms(model: nn.Module, tokenizer: Any, work: Workload, seed: int,
                 progress: Callable[[str], None] | None, kind: str) -> dict[str, Any]:
    arms = [run_arm(model, tokenizer, work, policy, seed, progress, kind) for policy in POLICIES]
    by = {a["policy"]: a for a in arms}
    best = by["min_waste"]
    goals = {
        "vs_always_discard": best["episodes_per_s"] / by["always_discard"]["episodes_per_s"],
        "vs_prefix_cache_only": best["episodes_per_s"] / by["prefix_cache_only"]["episodes_per_s"],
        "recomputed_fraction": best["recomputed_fraction"],
    }
    out = {"engine": kind, "workload": work.__dict__, "policies": arms, "goals": goals}
    if kind == "reference":  # the simulator models the reference engine's slots and swap tier
        out["simulation_inputs"] = simulation_inputs(work, arms)
    return out


def simulation_inputs(work: Workload, arms: list[dict[str, Any]]) -> dict[str, Any]:
    """The workload and this machine's measured costs, in rollwise.sim.intercept's terms."""
    prefill = statistics.median(a["measured"]["prefill_s_per_token"] for a in arms)
    step = statistics.median(a["measured"]["decode_s_per_step"] for a in arms)
    tool = statistics.median(a["measured"]["tool_s_median"] for a in arms)
    capacity = work.slots * work.max_model_len
    return {
        # prefix_cache_only ran on fewer slots (its cache is paid for with the pinnable ones): see _engine
        "prefix_cache_only_slots": work.slots - work.slots // 2,
        "cost": {"name": "measured-by-bench-intercept", "prefill_s_per_token": prefill, "step_overhead_s": step,
                 "max_num_seqs": work.slots, "max_model_len": work.max_model_len, "kv_capacity_tokens": capacity},
        "retention": {"slot_tokens": work.max_model_len, "pin_budget_tokens": work.slots // 2 * work.max_model_len,
                      "swap_budget_tokens": capacity * 4,
                      "swap_s_per_token": statistics.median(a["measured"]["swap_s_per_token"] for a in arms),
                      "prefix_cache_tokens": work.slots // 2 * work.max_model_len},
        "workload": {"sessions": work.sessions, "concurrency": work.concurrency, "turns": work.turns,
                     "prompt_tokens": work.prompt_tokens, "tool_result_tokens": work.tool_tokens,
                     "output_tokens": work.output_tokens,
                     "tools": [{"name": "calculator", "median_s": 1e-4, "sigma": 0.0},
                               {"name": "python", "median_s": max(1e-3, tool), "sigma": 0.3},
                               {"name": "slow", "median_s": work.slow_tool_median_s, "sigma": 1.0}]},
    }


def format_intercept_bench(result: dict[str, Any]) -> Group:
    """One table per engine run."""
    return Group(*(_table(r) for r in (result, result.get("vllm")) if r is not None))


def _table(result: dict[str, Any]) -> Table:
    kind = result.get("engine", "reference")
    table = Table(title=f"rollwise bench intercept: session KV retention across tool calls ({kind} engine)")
    for col in ("policy", "episodes/s", "recomputed", "waste (token-s)", "turn p50 s", "turn p99 s", "actions",
                "taken by admission"):
        table.add_column(col, justify="right")
    for arm in result["policies"]:
        taken = arm["taken_by_admission"]
        table.add_row(arm["policy"], f"{arm['episodes_per_s']:.3f}", f"{arm['recomputed_fraction']:.1%}",
                      f"{arm['waste_token_s']:.3g}", f"{arm['turn_latency_p50_s']:.3f}",
                      f"{arm['turn_latency_p99_s']:.3f}", ", ".join(f"{k} {v}" for k, v in arm["actions"].items()),
                      f"swap {taken['demoted_to_swap']}, drop {taken['pins_dropped'] + taken['turns_dropped_before_retain']}")
    g = result["goals"]
    table.caption = (f"min_waste vs always_discard {g['vs_always_discard']:.2f}x (goal >= 1.5), vs prefix cache "
                     f"{g['vs_prefix_cache_only']:.2f}x (goal >= 1.2); recomputed {g['recomputed_fraction']:.1%} "
                     "(goal <= 10%)")
    return table
