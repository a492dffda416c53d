"""Run a verifiers 0.4 (v1) taskset against a rollwise engine server or router: a standalone script, run under
the taskset's own interpreter (verifiers 0.4 needs `openai>=2.54,<3`, `renderers`, `mcp==2.0.0`), so it imports
nothing of rollwise.

    <python> verifiers_v1_driver.py '{"taskset": "verifiers-v1-echo", "base_url": "http://127.0.0.1:8000/v1",
                                      "model": "tiny:0", "renderer_model": "/path/to/tokenizer", "rollouts": 2}'

It loads the environment as `vf-eval` does (`load_environment(EnvConfig)`, the taskset's default harness
unless `harness` names one, the local `subprocess` runtime instead of the remote Prime sandbox), and runs each
rollout with verifiers' train client (`TrainClientConfig`): the harness's chat calls reach verifiers'
interception server, which renders them with the `renderers` package and POSTs token ids to
`{base}/inference/v1/generate` (`sampling` becomes its sampling_params; a `cache_salt` there goes top level)
with the header X-Session-ID, one per rollout. Other spec keys: `args` (the taskset config's fields), `tasks`
(how many of its tasks, default 1), `rollouts` (per task, default 1), `harness` (an id), `runtime` (default
`subprocess`), `api_key_var` (default ROLLWISE_API_KEY), `headers`. One JSON line per trace on stdout: reward,
errors, each call's finish_reason, and each branch (one training sample) with `token_ids`, `sampled_mask` and
`logprobs` (0.0 off the sampled positions), so a caller can check the tokens against what the engine produced.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any


def _replies_to_original_stdout() -> Any:
    """Replies go to the original stdout only; fd 1 becomes stderr, so verifiers' own prints never mix in."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _trace_record(task_id: str | None, trace: Any) -> dict[str, Any]:
    return {
        "task": task_id,
        "reward": trace.reward,
        "errors": [repr(e) for e in getattr(trace, "errors", None) or []],
        "calls": [{"finish_reason": c.finish_reason, "error": repr(c.error) if c.error else None} for c in trace.calls],
        "branches": [{"token_ids": b.token_ids, "sampled_mask": b.sampled_mask, "logprobs": b.logprobs,
                      "trainable": b.trainable} for b in trace.branches],
    }


async def main(spec: dict[str, Any], out: Any) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    agent: dict[str, Any] = {"runtime": {"type": spec.get("runtime", "subprocess")}}
    if spec.get("harness"):
        agent["harness"] = {"id": spec["harness"]}
    try:
        config = resolve_env_config({"taskset": {"id": spec["taskset"], **spec.get("args", {})}, "agent": agent})
        env = load_environment(config)
    except (ImportError, ValueError, TypeError, AttributeError) as exc:  # an unknown id, a bad arg (pydantic)
        raise SystemExit(f"verifiers_v1_driver: taskset {spec['taskset']!r}: {exc}".splitlines()[0]) from None
    client = vf.TrainClientConfig(base_url=spec["base_url"], renderer_model_name=spec["renderer_model"],
                                  api_key_var=spec.get("api_key_var", "ROLLWISE_API_KEY"),
                                  headers=spec.get("headers", {}))
    sampling = vf.SamplingConfig(**spec.get("sampling", {"temperature": 1.0, "max_tokens": 16}))
    ctx = vf.ModelContext(model=spec["model"], client=client, sampling=sampling)
    tasks = list(env.taskset)[: spec.get("tasks", 1)]
    async with env.serving():
        slots = [slot for task in tasks for slot in env.slots(task, spec.get("rollouts", 1))]
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))
    for episode in episodes:
        for error in episode.errors:
            out.write(json.dumps({"episode_error": repr(error)}) + "\n")
        for trace in episode.traces:
            out.write(json.dumps(_trace_record(episode.task.data.id, trace), default=repr) + "\n")


REQUIRED = ("taskset", "base_url", "model", "renderer_model")


def _spec(argv: list[str]) -> dict[str, Any]:
    """The one JSON argument, checked: a bad one is a one-line error naming the field, before verifiers loads."""
    try:
        spec = json.loads(argv[1]) if len(argv) == 2 else None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"verifiers_v1_driver: the argument is not JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise SystemExit("verifiers_v1_driver: pass one JSON object: " + json.dumps(dict.fromkeys(REQUIRED, "...")))
    missing = [key for key in REQUIRED if not isinstance(spec.get(key), str) or not spec[key]]
    if missing:
        raise SystemExit(f"verifiers_v1_driver: {', '.join(missing)}: required (a non-empty string)")
    return spec


if __name__ == "__main__":
    asyncio.run(main(_spec(sys.argv), _replies_to_original_stdout()))
