"""POST /score on the engine server: `Engine.score_tokens` over HTTP (rollwise.engine.scoring), so a teacher
served by `rollwise serve engine` scores a student's responses from another process or machine
(train.teacher.url, rollwise.control.teacher), a batch of sequences a request: at most MAX_SCORE_SEQUENCES of them
(400 beyond), in a body within the server's --max-request-bytes (413 beyond, before it is read)."""

from __future__ import annotations

from fastapi import FastAPI

from rollwise.engine.scoring import ScoreRequest, ScoreResponse
from rollwise.engine.service import EngineService
from rollwise.serve.errors import APIError, error_responses

ROUTE = "/score"


def add_score_route(app: FastAPI, server: EngineService) -> None:
    """Register POST /score: {sequences: [{token_ids, start}], temperature} -> {logprobs: per sequence, one per
    token_ids[start:]}."""

    @app.post(ROUTE, response_model=ScoreResponse, responses=error_responses(400, 409, 413, 503))
    async def score(body: ScoreRequest) -> ScoreResponse:
        try:
            logprobs = await server.frontend.call(lambda e: e.score_tokens(body.sequences, body.temperature))
        except ValueError as exc:  # named by rollwise.engine.scoring.check_score_request
            raise APIError(400, str(exc), "sequences") from exc
        except RuntimeError as exc:  # vLLM: requests in flight
            raise APIError(409, str(exc), "sequences", kind="conflict") from exc
        return ScoreResponse(logprobs=logprobs)
