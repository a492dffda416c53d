"""The environment server: OpenEnv's HTTP/WebSocket API, served with FastAPI (no openenv-core needed).

    uvicorn arith_env.server:app --port 8000        # or: python -m arith_env.server --port 8000

The same routes and messages as openenv-core's `create_app` (openenv.core.env_server.http_server):

    GET  /health                 {"status": "healthy"}
    GET  /metadata, /schema      the environment's name; the action / observation / state JSON schemas
    POST /reset, /step           one fresh environment per call (OpenEnv's stateless HTTP mode)
    GET  /state
    WS   /ws                     one environment per connection, for whole episodes:
        -> {"type": "reset", "data": {"seed": 3, "episode_id": "..."}}   <- {"type": "observation", "data": {...}}
        -> {"type": "step", "data": {"message": "..."}}                  <- {"type": "observation", "data": {...}}
        -> {"type": "state"}                                             <- {"type": "state", "data": {...}}
        -> {"type": "close"}
        an observation's data: {"observation": {prompt, attempt}, "reward": float | null, "done": bool};
        a bad message: {"type": "error", "data": {"message": "...", "code": "VALIDATION_ERROR" | ...}}
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fastapi import Body, FastAPI, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ValidationError

from arith_env.env import ArithAction, ArithEnvironment, ArithObservation, ArithState


def serialize(obs: ArithObservation) -> dict[str, Any]:
    """OpenEnv's serialize_observation: reward and done beside the observation's own fields."""
    return {"observation": obs.model_dump(exclude={"reward", "done", "metadata"}), "reward": obs.reward,
            "done": obs.done}


class ResetRequest(BaseModel):
    seed: int | None = None
    episode_id: str | None = None


class StepRequest(BaseModel):
    action: dict[str, Any]


def _error(message: str, code: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


def create_app() -> FastAPI:
    app = FastAPI(title="arith_env: an OpenEnv environment")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "healthy"}

    @app.get("/metadata")
    def metadata() -> dict[str, str]:
        return {"name": "arith_env", "description": "arithmetic with feedback and retries", "version": "0.1.0"}

    @app.get("/schema")
    def schema() -> dict[str, Any]:
        return {"action": ArithAction.model_json_schema(), "observation": ArithObservation.model_json_schema(),
                "state": ArithState.model_json_schema()}

    @app.post("/reset")
    def reset(request: ResetRequest = Body(default_factory=ResetRequest)) -> dict[str, Any]:
        return serialize(ArithEnvironment().reset(seed=request.seed, episode_id=request.episode_id))

    @app.post("/step")
    def step(request: StepRequest) -> dict[str, Any]:
        env = ArithEnvironment()  # stateless, as OpenEnv's HTTP /step: episodes run over /ws
        return serialize(env.step(ArithAction.model_validate(request.action)))

    @app.get("/state")
    def state() -> dict[str, Any]:
        return ArithEnvironment().state.model_dump()

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        env = ArithEnvironment()
        try:
            while True:
                raw = await websocket.receive_text()
                try:
                    message = json.loads(raw)
                except ValueError as exc:
                    await websocket.send_text(_error(f"Invalid JSON: {exc}", "INVALID_JSON"))
                    continue
                kind, data = message.get("type"), message.get("data") or {}
                try:
                    if kind == "reset":
                        request = ResetRequest.model_validate(data)
                        reply = {"type": "observation", "data": serialize(env.reset(request.seed, request.episode_id))}
                    elif kind == "step":
                        reply = {"type": "observation", "data": serialize(env.step(ArithAction.model_validate(data)))}
                    elif kind == "state":
                        reply = {"type": "state", "data": env.state.model_dump()}
                    elif kind == "close":
                        break
                    else:
                        await websocket.send_text(_error(f"Unknown message type: {kind}", "UNKNOWN_TYPE"))
                        continue
                except ValidationError as exc:
                    await websocket.send_text(_error("Invalid message", "VALIDATION_ERROR",
                                                     errors=json.loads(exc.json())))
                    continue
                await websocket.send_text(json.dumps(reply))
        except WebSocketDisconnect:
            pass
        finally:
            env.close()

    return app


app = create_app()


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port)
