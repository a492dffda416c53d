"""An OpenEnv environment worker: a standalone script (stdlib + aiohttp, never rollwise) that drives an OpenEnv
environment server over its published API and the policy through a rollwise proxy session.

    <python> openenv_worker.py '{"url": "http://host:8000"}'                          # a server already running
    <python> openenv_worker.py '{"start": {"app": "guess_env.server:app", "python": "/venv/bin/python"}}'

With `start`, the worker runs the server itself (`<python> -m uvicorn <app> --port <free port>`, or `command`
with "{port}" replaced), under the environment's own interpreter, in the worker's process group: when rollwise
kills the worker, the server goes with it. A server that dies (or hangs as a whole: a step timed out and
/health does not answer) is started again before the next episode; the episodes it was running fail.

OpenEnv's HTTP /reset and /step make a fresh environment per call (no episode across calls), so an episode runs
over the WebSocket session `/ws`, one connection per rollout: {"type": "reset", "data": {seed, episode_id}},
then {"type": "step", "data": <action>} until `done` or `max_turns`, each answered {"type": "observation",
"data": {observation, reward, done}} (or {"type": "error", "data": {message}}). Each turn the observation
becomes a user message, the policy's answer (OpenAI chat completions at `base_url`, which records the engine's
exact tokens) becomes the action's `action_field`. The reward is the sum of the step rewards (or the last one).
A server that errors, hangs (`step_timeout_s`) or answers something else fails that rollout with the reason.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

# Replies go to the original stdout only; fd 1 becomes stderr (what the server or libraries print never lands
# between replies).
_PROTO = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr
_WRITE = threading.Lock()

import aiohttp  # noqa: E402  (after the fd swap: nothing it prints may reach the protocol stream)


class EpisodeError(Exception):
    """What the environment server did wrong in one episode (its reason goes back as the rollout's error)."""

    def __init__(self, message: str, timed_out: bool = False, disconnected: bool = False) -> None:
        super().__init__(message)
        self.timed_out, self.disconnected = timed_out, disconnected


def send(obj: dict[str, Any]) -> None:
    line = json.dumps(obj, allow_nan=True)
    with _WRITE:
        _PROTO.write(line + "\n")
        _PROTO.flush()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(start: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str]:
    """Run the environment server (inheriting this process group and stderr); its base URL."""
    port = _free_port()
    python = start.get("python") or sys.executable
    if start.get("command"):
        argv = [str(a).replace("{port}", str(port)) for a in start["command"]]
    else:
        argv = [python, "-m", "uvicorn", start["app"], "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
    env = {**os.environ, **(start.get("env") or {})}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=2, stderr=2, env=env, cwd=start.get("cwd"))
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float,
                       proc: subprocess.Popen[bytes] | None) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise EpisodeError(f"the environment server exited with code {proc.returncode} before it was healthy "
                               "(run its start command by hand to see why; for `start.app`: is the environment's "
                               "package installed for `start.python`, e.g. pip install -e <its directory>?)")
        try:
            async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = type(exc).__name__
        await asyncio.sleep(0.1)
    raise EpisodeError(f"the environment server at {url} was not healthy within {timeout_s:g}s ({last})")


def observation_text(obs: Any, field: str | None) -> str:
    """The user message for an observation: its `field`, else its only text field, else the whole JSON."""
    if not isinstance(obs, dict):
        raise EpisodeError(f"observation is not an object: {str(obs)[:200]}")
    if field is not None:
        if not isinstance(obs.get(field), str):
            raise EpisodeError(f"observation has no text field {field!r} (it has {sorted(obs)[:20]})")
        return obs[field]
    texts = [v for v in obs.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 else json.dumps(obs, sort_keys=True)


class Episode:
    """One rollout: a WebSocket session with the environment, turns with the policy."""

    def __init__(self, worker: Worker, request: dict[str, Any]) -> None:
        self.worker, self.request = worker, request
        self.cfg = worker.cfg

    async def _exchange(self, ws: aiohttp.ClientWebSocketResponse, message: dict[str, Any]) -> dict[str, Any]:
        await ws.send_str(json.dumps(message))
        try:
            frame = await asyncio.wait_for(ws.receive(), timeout=self.cfg.get("step_timeout_s", 60.0))
        except asyncio.TimeoutError:
            raise EpisodeError(f"timeout: the environment did not answer {message['type']} within "
                               f"{self.cfg.get('step_timeout_s', 60.0):g}s", timed_out=True) from None
        if frame.type == aiohttp.WSMsgType.ERROR:  # e.g. a message over max_msg_size
            raise EpisodeError(f"the environment's answer to {message['type']} was refused: {frame.data}")
        if frame.type != aiohttp.WSMsgType.TEXT:
            raise EpisodeError(f"the environment closed the session on {message['type']} ({frame.type.name})",
                               disconnected=True)
        try:
            reply = json.loads(frame.data)
        except ValueError:
            raise EpisodeError(f"the environment's answer to {message['type']} is not JSON: "
                               f"{str(frame.data)[:200]!r}") from None
        if not isinstance(reply, dict):
            raise EpisodeError(f"the environment's answer to {message['type']} is not an object")
        data = reply.get("data")
        if reply.get("type") == "error":
            detail = data.get("message") if isinstance(data, dict) else data
            raise EpisodeError(f"the environment refused {message['type']}: {str(detail)[:300]}")
        if reply.get("type") != "observation" or not isinstance(data, dict):
            raise EpisodeError(f"the environment's answer to {message['type']} is not an observation: "
                               f"{json.dumps(reply)[:200]}")
        reward, done = data.get("reward"), data.get("done", False)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise EpisodeError(f"the environment's reward is not a finite number: {reward!r}")
        if not isinstance(done, bool):
            raise EpisodeError(f"the environment's done is not true/false: {done!r}")
        return data

    async def _policy(self, messages: list[dict[str, str]], later_turn: bool) -> str | None:
        """The policy's reply; None when the session is out of room (the proxy's 400/413: a context, turn or
        token limit), which ends the episode where it is, as a cut-off one."""
        req = self.request
        body = {"model": req["model"], "messages": messages, **req.get("sampling", {})}
        async with self.worker.http.post(f"{req['base_url']}/chat/completions", json=body) as r:
            if r.status in (400, 413) and later_turn:  # a limit the conversation grew into, not a bad request
                return None
            if r.status != 200:
                raise EpisodeError(f"the policy call failed: HTTP {r.status}: {(await r.text())[:300]}")
            out = await r.json()
        message = out["choices"][0]["message"]
        return message.get("content") or ""

    async def run(self) -> dict[str, Any]:
        cfg, req = self.cfg, self.request
        seed = req["index"] + (cfg.get("eval_seed_offset", 1_000_000) if req.get("split") == "eval" else 0)
        messages: list[dict[str, str]] = []
        if cfg.get("system_prompt"):
            messages.append({"role": "system", "content": cfg["system_prompt"]})
        rewards: list[float] = []
        answer, cut = "", False
        await self.worker.ensure_server()
        ws_url = self.worker.url.replace("http", "ws", 1) + "/ws"  # after: a restarted server has a new port
        try:
            async with self.worker.http.ws_connect(ws_url, max_msg_size=1 << 20) as ws:
                data = await self._exchange(ws, {"type": "reset",
                                                 "data": {"seed": seed, "episode_id": req["id"], **cfg.get("reset", {})}})
                turns = 0
                while not data.get("done", False) and turns < cfg.get("max_turns", 8):
                    messages.append({"role": "user", "content": observation_text(data.get("observation"),
                                                                                 cfg.get("observation_field"))})
                    reply = await self._policy(messages, later_turn=turns > 0)
                    if reply is None:
                        cut = True
                        break
                    answer = reply
                    messages.append({"role": "assistant", "content": answer})
                    turns += 1
                    data = await self._exchange(ws, {"type": "step", "data": {cfg.get("action_field", "message"): answer}})
                    if data.get("reward") is not None:
                        rewards.append(float(data["reward"]))
                await ws.send_str(json.dumps({"type": "close"}))
        except aiohttp.ClientError as exc:
            raise EpisodeError(f"the environment server connection failed: {type(exc).__name__}: {exc}",
                               disconnected=True) from None
        reward = (rewards[-1] if rewards else 0.0) if cfg.get("reward") == "last" else sum(rewards)
        return {"reward": reward, "turns": turns, "final_text": answer,
                "metrics": {"done": float(bool(data.get("done", False))), "cut": float(cut)}}  # logged as env_<name>


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.server: subprocess.Popen[bytes] | None = None
        self.url: str = (cfg.get("url") or "").rstrip("/")
        self.http: aiohttp.ClientSession
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._restart = asyncio.Lock()

    async def ensure_server(self) -> None:
        """The server this worker started is running: started again if it exited (episodes wait for it)."""
        if self.server is None or self.server.poll() is None:
            return
        async with self._restart:
            if self.server.poll() is None:
                return  # another episode restarted it
            print(f"openenv worker: the environment server exited with code {self.server.returncode}; "
                  "starting it again", file=sys.stderr)
            self.server, self.url = start_server(self.cfg["start"])
            await wait_healthy(self.http, self.url, self.cfg.get("start_timeout_s", 60.0), self.server)

    async def after_failure(self, exc: EpisodeError) -> None:
        """An episode failed: if the server is the cause, make sure the next episode gets a fresh one."""
        if self.server is None:
            return
        if exc.timed_out and not await self.healthy():
            self.server.kill()  # hung as a whole, not just this episode
        elif not exc.disconnected:
            return  # garbage, or one episode hanging: the server itself is fine
        try:  # a server that crashed closes its sockets a moment before it is reaped: let it finish exiting
            await asyncio.to_thread(self.server.wait, 1.0)
        except subprocess.TimeoutExpired:
            pass  # still running: only that episode went wrong

    async def start(self) -> None:
        # No connection limit (aiohttp's default is 100): every episode holds a WebSocket to the server while it
        # calls the policy, and a capped pool of both deadlocks once that many episodes run at once.
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_read=600))
        if self.cfg.get("start"):
            self.server, self.url = start_server(self.cfg["start"])
        await wait_healthy(self.http, self.url, self.cfg.get("start_timeout_s", 60.0), self.server)
        send({"type": "hello", "ok": True, "train_size": self.cfg.get("train_size", 100_000),
              "eval_size": self.cfg.get("eval_size", 50)})

    async def healthy(self) -> bool:
        try:
            async with self.http.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def rollout(self, request: dict[str, Any]) -> None:
        rid = request["id"]
        try:
            result = await Episode(self, request).run()
            send({"type": "result", "id": rid, "ok": True, **result})
        except asyncio.CancelledError:
            pass
        except EpisodeError as exc:
            await self.after_failure(exc)
            send({"type": "result", "id": rid, "ok": False, "error": str(exc)})
        except Exception as exc:  # noqa: BLE001  what the server sent broke an assumption: this rollout only
            send({"type": "result", "id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]})
        finally:
            self.tasks.pop(rid, None)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("type") == "ping":
                send({"type": "pong", "id": msg.get("id")})
            elif msg.get("type") == "rollout":
                self.tasks[msg["id"]] = asyncio.create_task(self.rollout(msg))
            elif msg.get("type") == "cancel" and msg.get("id") in self.tasks:
                self.tasks[msg["id"]].cancel()


async def main(cfg: dict[str, Any]) -> None:
    worker = Worker(cfg)
    try:
        await worker.start()
    except EpisodeError as exc:
        send({"type": "hello", "ok": False, "error": str(exc)})
        raise SystemExit(1) from None
    try:
        await worker.serve()
    finally:
        if worker.server is not None and worker.server.poll() is None:
            worker.server.send_signal(signal.SIGTERM)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
