"""A classic-verifiers (<= 0.3.1) environment worker: a standalone script, run by rollwise under the
environment's own interpreter (`task.python`), so it imports nothing of rollwise (stdlib + verifiers +
openai + the environment's package only).

    <python> verifiers_worker.py '{"env": "calc-env", "args": {...}}'

It loads the environment with `vf.load_environment(env, **args)`, says hello (dataset sizes), then serves
the JSON-lines protocol of rollwise.environments.protocol: each rollout runs as an asyncio task with the
environment's own AsyncOpenAI client pointed at `base_url` (a rollwise proxy session, which records the
exact tokens), asking for logprobs and token ids as the classic client does for training. The reward is
the environment's rubric; a reward function that raised (verifiers logs it and scores 0.0) or an error
the environment recorded fails the rollout with that reason.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
import sys
import threading
from typing import Any

# Replies go to the original stdout only; fd 1 becomes stderr, so what the environment prints (print,
# logging, C extensions) never lands between replies.
_PROTO = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr
_WRITE = threading.Lock()

_ROLLOUT_ERRORS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rollout_errors", default=None)


def send(obj: dict[str, Any]) -> None:
    line = json.dumps(obj, default=repr, allow_nan=True)
    with _WRITE:
        _PROTO.write(line + "\n")
        _PROTO.flush()


class _RolloutErrors(logging.Handler):
    """verifiers logs (and scores 0.0) a reward function that raised: record it against the rollout whose
    task logged it (asyncio tasks carry their own context)."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _ROLLOUT_ERRORS.get()
        if errors is not None and record.levelno >= logging.ERROR:
            errors.append(record.getMessage()[:500])


def _assistant_text(completion: Any) -> tuple[str, int]:
    if not isinstance(completion, list):
        return (str(completion or ""), 1)
    texts = []
    for m in completion:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        if role == "assistant":
            texts.append(content if isinstance(content, str) else "")
    return (texts[-1] if texts else "", len(texts))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _sampling(req: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling as the classic client sends it for training: logprobs and token ids returned."""
    s = req.get("sampling", {})
    return {"temperature": s.get("temperature", 1.0), "top_p": s.get("top_p", 1.0),
            "max_tokens": s.get("max_tokens", 256), "logprobs": True, "extra_body": {"return_token_ids": True}}


def _reply(rid: str, out: dict[str, Any], errors: list[str]) -> dict[str, Any]:
    text, turns = _assistant_text(out.get("completion"))
    problems = list(errors)
    if out.get("error"):
        problems.insert(0, f"the environment recorded an error: {str(out['error'])[:300]}")
    reply: dict[str, Any] = {"type": "result", "id": rid, "ok": not problems, "reward": out.get("reward"),
                             "metrics": out.get("metrics") or {}, "turns": turns, "final_text": text[-2000:]}
    if problems:
        reply.update(error=f"reward/rollout error: {problems[0]}", reward=0.0,
                     metrics={k: v for k, v in reply["metrics"].items() if _finite(v)})
    return reply


class _SessionRouter:
    """A verifiers client for a group: each rollout (by its state's trajectory_id) gets one proxy session of its
    own on its first model call, with that member's seed, so the trainer sees each rollout as one trajectory."""

    def __init__(self, vf: Any, sessions: list[tuple[str, int]]) -> None:
        from openai import AsyncOpenAI

        self.free = list(sessions)
        self.routes: dict[str, str] = {}  # trajectory_id -> base_url
        self.seeds = dict(sessions)
        self.clients = {url: vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=url, api_key="rollwise", max_retries=0))
                        for url, _ in sessions}
        base = vf.OpenAIChatCompletionsClient  # a real vf.Client, so verifiers' resolve_client takes it as is
        router = self

        class Routed(base):  # type: ignore[misc, valid-type]
            async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):  # noqa: ANN001, ANN201
                tid = str(kwargs["state"]["trajectory_id"])
                if tid not in router.routes:
                    if not router.free:
                        raise RuntimeError("more rollouts in the group than sessions")
                    router.routes[tid] = router.free.pop(0)[0]
                url = router.routes[tid]
                args = {**sampling_args, "seed": router.seeds[url]}
                return await router.clients[url].get_response(prompt, model, args, tools, **kwargs)

        self.client = Routed(next(iter(self.clients.values())).client)

    def used_ids(self, by_url: dict[str, str]) -> set[str]:
        return {by_url[u] for u in self.routes.values()}

    async def close_all(self) -> None:
        for c in self.clients.values():
            await c.client.close()


class Worker:
    def __init__(self, env: Any) -> None:
        self.env = env
        self.rows: dict[str, list[dict[str, Any]]] = {"train": env.get_dataset().to_list()}
        try:
            self.rows["eval"] = env.get_eval_dataset().to_list()
        except Exception:  # noqa: BLE001 - an env without any eval source: train rows are held out by index
            self.rows["eval"] = self.rows["train"]
        self.tasks: dict[str, asyncio.Task[None]] = {}
        # verifiers scores some environments by group (group reward functions): their rollouts wait here for
        # every member of their group, then run and are scored together, as the environment's run_group does.
        self.grouped = bool(getattr(env, "requires_group_rollouts", False))
        self.waiting: dict[str, list[dict[str, Any]]] = {}

    async def rollout(self, req: dict[str, Any]) -> None:
        from openai import AsyncOpenAI

        import verifiers as vf

        rid = req["id"]
        errors: list[str] = []
        _ROLLOUT_ERRORS.set(errors)
        rows = self.rows[req.get("split", "train")]
        row = dict(rows[int(req["index"]) % len(rows)])
        native = AsyncOpenAI(base_url=req["base_url"], api_key="rollwise", max_retries=0)
        try:
            client = vf.OpenAIChatCompletionsClient(native)
            out = await self.env.run_rollout(row, client, req["model"], {**_sampling(req), "seed": req.get("seed", 0)})
            send(_reply(rid, dict(out), errors))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's failure costs this rollout only
            send({"type": "result", "id": rid, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        finally:
            self.tasks.pop(rid, None)
            await native.close()

    async def group(self, reqs: list[dict[str, Any]]) -> None:
        """One group through the environment's run_group; each member's model calls go to its own proxy session."""
        import verifiers as vf

        errors: list[str] = []
        _ROLLOUT_ERRORS.set(errors)
        first = reqs[0]
        rows = self.rows[first.get("split", "train")]
        inputs = [dict(rows[int(r["index"]) % len(rows)]) for r in reqs]
        client = _SessionRouter(vf, [(r["base_url"], r.get("seed", 0)) for r in reqs])
        by_url = {r["base_url"]: r["id"] for r in reqs}
        try:
            outs = await self.env.run_group(inputs, client.client, first["model"], _sampling(first),
                                            state_columns=["trajectory_id"])
            replies: dict[str, dict[str, Any]] = {}
            spare = [r["id"] for r in reqs]
            for out in outs:  # a member that never called the model has no session: any spare id is its
                url = client.routes.get(out.get("trajectory_id"))
                rid = by_url[url] if url is not None else next(i for i in spare if i not in client.used_ids(by_url))
                spare.remove(rid)
                replies[rid] = _reply(rid, dict(out), errors)
            for r in reqs:
                send(replies[r["id"]])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the environment's failure costs this group only
            for r in reqs:
                send({"type": "result", "id": r["id"], "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
        finally:
            for r in reqs:
                self.tasks.pop(r["id"], None)
            await client.close_all()

    def handle(self, line: str) -> None:
        try:
            req = json.loads(line)
        except ValueError:
            return
        kind = req.get("type")
        if kind == "ping":
            send({"type": "pong", "id": req.get("id")})
        elif kind == "rollout" and self.grouped and req.get("group") is not None:
            members = self.waiting.setdefault(req["group"], [])
            members.append(req)
            if len(members) >= int(req.get("group_size", 1)):
                del self.waiting[req["group"]]
                task = asyncio.get_running_loop().create_task(self.group(members))
                for m in members:
                    self.tasks[m["id"]] = task
        elif kind == "rollout":
            self.tasks[req["id"]] = asyncio.get_running_loop().create_task(self.rollout(req))
        elif kind == "cancel" and req.get("id") in self.tasks:
            self.tasks[req["id"]].cancel()


async def serve(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    def read() -> None:  # stdin on a thread: the loop keeps running rollouts (and answering pings)
        for line in sys.stdin:
            loop.call_soon_threadsafe(queue.put_nowait, line)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=read, daemon=True).start()
    while (line := await queue.get()) is not None:
        worker.handle(line)


def main() -> None:
    config = json.loads(sys.argv[1])
    try:
        import verifiers as vf

        env = vf.load_environment(config["env"], **config.get("args", {}))
        verifiers_log = logging.getLogger("verifiers")  # verifiers stops it from propagating to the root
        verifiers_log.addHandler(_RolloutErrors())
        verifiers_log.setLevel(min(verifiers_log.level or logging.WARNING, logging.ERROR))
        worker = Worker(env)
        if not worker.rows["train"]:
            raise ValueError("the environment's dataset is empty")
    except Exception as exc:  # noqa: BLE001 - reported to rollwise as the reason the environment did not load
        send({"type": "hello", "ok": False, "error": f"load_environment({config.get('env')!r}) failed: "
                                                     f"{type(exc).__name__}: {str(exc)[:500]}"})
        return
    send({"type": "hello", "ok": True, "train_size": len(worker.rows["train"]), "eval_size": len(worker.rows["eval"]),
          "group_rollouts": worker.grouped})
    asyncio.run(serve(worker))


if __name__ == "__main__":
    main()
