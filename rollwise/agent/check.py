"""`rollwise check tito`: prove token-in/token-out on a real engine, turn by turn.

1. Template probe (no engine): renders synthetic conversations through the model's chat template
   and reports which message transitions keep the prefix-extension property and which make the
   trajectory split (templates that rewrite earlier turns, e.g. strip reasoning).
2. Episodes: multi-turn conversations with tool calls through a real engine (reference or vLLM).
   The model's tool calls run (calculator), broken ones get error results, and a reply without a
   call gets a user nudge, so every episode has several turns. Every engine call is recorded and
   compared with the trajectory the trainer would receive: prompt = trajectory prefix, sampled ids,
   logprobs and versions equal, loss mask exactly on the sampled spans, and the trainer's own
   logprob recompute on the trajectory's ids agrees with the engine's.

Exit code 1 on any violation (with --strict-prefix also when the template breaks the prefix property).
`tiny:SEED` models are first taught the toy tool-call format (rollwise.agent.toy; seconds, cached),
so that their turns contain real tool calls.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table

from rollwise.agent.episode import ToolAgent, run_episode
from rollwise.agent.generator import LocalGenerator
from rollwise.agent.session import AgentSession, SessionLimits
from rollwise.agent.template import ChatRenderer
from rollwise.agent.tools import CalculatorTool, ToolRegistry
from rollwise.agent.toy import toy_question
from rollwise.agent.trajectory import TrajectoryBuilder
from rollwise.agent.verify import RecordingGenerator, TitoReport, verify_trajectory
from rollwise.types.generation import Completion

if TYPE_CHECKING:
    from torch import nn

    from rollwise.engine.contract import Engine


# ---------------------------------------------------------------------------------------- template probe


@dataclass
class ProbeResult:
    transition: str
    keeps_prefix: bool
    detail: str


_REPLY = "Let me compute. <tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2+3\"}}</tool_call>"
_THINK_REPLY = "<think>2 and 3 make 5.</think>The answer is 5."


def probe_template(renderer: ChatRenderer, eos_token_ids: list[int]) -> list[ProbeResult]:
    """Each transition: a conversation, an assistant turn (the canonical ids of a reply, as if
    sampled, ending with the end-of-turn token), then the next message. Does the builder extend the
    held ids, or does it have to split?"""
    tok = renderer.tokenizer
    eos = eos_token_ids[0]
    opening = [{"role": "system", "content": "You are a careful assistant."}, {"role": "user", "content": "2+3?"}]
    cases = [
        ("assistant -> tool", _REPLY, [{"role": "tool", "content": "5"}]),
        ("assistant -> user", _REPLY, [{"role": "user", "content": "Are you sure?"}]),
        ("assistant -> system", _REPLY, [{"role": "system", "content": "Two turns left."}]),
        ("assistant -> tool, tool", _REPLY, [{"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}]),
        ("assistant (reasoning) -> user", _THINK_REPLY, [{"role": "user", "content": "Thanks. And 3+4?"}]),
    ]
    out = []
    for name, reply, follow in cases:
        builder = TrajectoryBuilder(renderer, eos_token_ids, "probe")
        try:
            builder.start(opening)
            ids = tok.encode(reply, add_special_tokens=False) + [eos]
            builder.add_completion(Completion("probe", 0, builder.prompt_ids(), ids, [0.0] * len(ids),
                                              [0] * len(ids), "stop"))
            builder.extend(follow)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render a role is a finding too
            out.append(ProbeResult(name, False, f"cannot render: {type(exc).__name__}: {exc}"[:200]))
            continue
        traj = builder.trajectory()
        if traj.splits:
            out.append(ProbeResult(name, False, traj.splits[0]))
        else:
            tail = traj.segments[0].token_ids[traj.segments[0].spans[0].end:]
            out.append(ProbeResult(name, True, f"template tokens after the turn: {tok.decode(tail)!r}"[:200]))
    return out


# ---------------------------------------------------------------------------------------- episodes


class _CheckAgent(ToolAgent):
    """Runs tool calls; nudges with a user message when there is none, so episodes have many turns."""

    def step(self, turn, session):  # noqa: ANN001, ANN201
        return super().step(turn, session) or [{"role": "user", "content": "Check it with the calculator."}]


def _load(model_spec: str, engine_kind: str, max_model_len: int, seed: int) -> tuple[nn.Module, Any, Engine]:
    from rollwise.types.engine_config import EngineConfig
    from rollwise.engine.factory import create_engine, resolve_engine_kind
    from rollwise.model.loading import load_model, tokenizer_fingerprint

    kind = resolve_engine_kind(engine_kind, model_spec)
    if kind == "vllm" and model_spec.startswith("tiny:"):
        raise ValueError("tiny: test models have a head size (16) that vLLM's CPU attention kernels refuse: "
                         "use --engine reference, or a real model with --engine vllm")
    if model_spec.startswith("tiny:"):
        from rollwise.agent.toy import toy_tool_model

        model, tokenizer = toy_tool_model(seed=int(model_spec[5:] or 0))
    else:
        model, tokenizer = load_model(model_spec)
    section = EngineConfig(kind=kind, max_num_seqs=8, max_model_len=max_model_len)
    engine = create_engine(section, model, tokenizer,
                           eos_token_ids=[tokenizer.eos_token_id], seed=seed, model_name=model_spec,
                           tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    return model, tokenizer, engine


def run_check(model_spec: str = "tiny:0", engine_kind: str = "auto", episodes: int = 3, max_turns: int = 4,
              max_tokens: int = 120, seed: int = 0, logprob_tol: float = 1e-3,
              console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    t0 = time.monotonic()
    with console.status(f"loading {model_spec}"):
        model, tokenizer, engine = _load(model_spec, engine_kind, 1024, seed)
    renderer = ChatRenderer(tokenizer)
    eos = [tokenizer.eos_token_id]
    probes = probe_template(renderer, eos)
    generator = LocalGenerator(engine)
    rng = random.Random(seed)
    # The toy model learned its prompt without a tool list; real models get the tools described.
    tools = None if model_spec.startswith("tiny:") else [CalculatorTool().spec()]
    reports: list[TitoReport] = []
    tool_ok = tool_errors = 0
    try:
        for e in range(episodes):
            recorder = RecordingGenerator(generator)
            session = AgentSession(recorder, tokenizer, seed=seed + 1000 * e, limits=SessionLimits(max_turns=max_turns),
                                   tools=tools)
            agent = _CheckAgent(ToolRegistry([CalculatorTool()]))
            with console.status(f"episode {e + 1}/{episodes}"):
                result = run_episode(session, toy_question(rng), agent, max_tokens=max_tokens)
            reports.append(verify_trajectory(result.trajectory, recorder.calls, model=model, logprob_tol=logprob_tol))
            tool_ok += sum(not r.error for r in agent.results)
            tool_errors += sum(r.error for r in agent.results)
    finally:
        generator.close()
        getattr(engine, "close", lambda: None)()
    return {
        "model": model_spec, "engine": engine.name, "seconds": time.monotonic() - t0,
        "probes": [asdict(p) for p in probes],
        "episodes": [{"turns": [asdict(t) for t in r.turns], "violations": r.violations, "splits": r.splits,
                      "masked_tokens": r.masked_tokens, "sampled_tokens": r.sampled_tokens} for r in reports],
        "tool_calls_ok": tool_ok, "tool_call_errors": tool_errors,
        "violations": [f"episode {i}: {v}" for i, r in enumerate(reports) for v in r.violations],
        "template_breaks": [p.transition for p in probes if not p.keeps_prefix]
        + [s for r in reports for s in r.splits],
    }


def _mark(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗ NO[/]"


def render_report(result: dict[str, Any], console: Console) -> None:
    probe = Table(title=f"chat template of {result['model']}: prefix-extension property")
    probe.add_column("transition", no_wrap=True)
    probe.add_column("extends", no_wrap=True)
    probe.add_column("template tokens appended / why it splits", overflow="fold")
    for p in result["probes"]:
        detail = p["detail"].removeprefix("template tokens after the turn: ")
        probe.add_row(p["transition"], "[green]yes[/]" if p["keeps_prefix"] else "[yellow]no: split[/]", detail)
    console.print(probe)
    table = Table(title=f"engine turns vs trajectory ({result['engine']} engine)", box=box.SIMPLE_HEAD,
                  pad_edge=False, collapse_padding=True)
    # prefix: the engine's prompt was the trajectory so far; ids/logp/ver: the trajectory's span equals
    # what the engine returned; Δlogp: trainer recompute vs engine; drift: decode->encode differs.
    for col in ("ep", "turn", "seg", "prompt", "new", "finish", "prefix", "ids", "logp", "ver", "Δlogp", "drift"):
        table.add_column(col, justify="right" if col in ("ep", "turn", "seg", "prompt", "new") else "left",
                         no_wrap=True, min_width=len(col))
    for i, ep in enumerate(result["episodes"]):
        for t in ep["turns"]:
            diff = t["trainer_max_abs_logprob_diff"]
            table.add_row(str(i), str(t["turn"]), str(t["segment"]), str(t["prompt_tokens"]), str(t["sampled_tokens"]),
                          {"length": "len"}.get(t["finish_reason"], t["finish_reason"]), _mark(t["prompt_is_prefix"]), _mark(t["ids_equal"]),
                          _mark(t["logprobs_equal"]), _mark(t["versions_equal"]),
                          "-" if diff is None else f"{diff:.1e}",
                          "[yellow]yes[/]" if t["retokenization_drift"] else "-")
    console.print(table)
    console.print("prefix: the engine's prompt was the trajectory so far; ids/logp/ver: the trajectory holds "
                  "exactly what the engine sampled; Δlogp: trainer recompute vs engine; drift: decode -> encode "
                  "would give other ids")
    turns = sum(len(ep["turns"]) for ep in result["episodes"])
    console.print(f"{len(result['episodes'])} episodes, {turns} engine turns, tool calls: {result['tool_calls_ok']} run, "
                  f"{result['tool_call_errors']} answered with an error; {result['seconds']:.1f}s")
    drift = sum(t["retokenization_drift"] for ep in result["episodes"] for t in ep["turns"])
    if drift:
        console.print(f"[yellow]{drift} turn(s) would have been re-tokenized differently from what was sampled[/] "
                      "(decode -> encode is not the identity): the trajectory kept the sampled ids")
    for b in result["template_breaks"]:
        console.print(f"[yellow]template breaks the prefix property:[/] {b} -> the trajectory splits there")
    if result["violations"]:
        for v in result["violations"]:
            console.print(f"[red]TITO violation:[/] {v}")
    else:
        console.print("[green]TITO holds:[/] every sampled token reaches the trainer as sampled, with its logprob "
                      "and policy version, and nothing else carries loss")


def cli_check_tito(args: argparse.Namespace, console: Console) -> int:
    model = getattr(args, "model", None) or "tiny:0"
    episodes = getattr(args, "episodes", None)
    episodes = 3 if episodes is None else episodes
    if episodes < 1:
        console.print(f"[red]error:[/] --episodes must be >= 1, got {episodes}")
        return 2
    try:
        result = run_check(model, getattr(args, "engine", None) or "auto", episodes=episodes,
                           seed=getattr(args, "seed", None) or 0, console=console)
    except ValueError as exc:  # a model spec or engine choice that cannot work, said plainly
        console.print(f"[red]error:[/] {exc}")
        return 2
    render_report(result, console)
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(result, indent=2))
        console.print(f"wrote {args.json}")
    failed = bool(result["violations"]) or (getattr(args, "strict_prefix", False) and bool(result["template_breaks"]))
    return 1 if failed else 0
