"""A token-level client for `rollwise serve engine`: the engine contract over HTTP.

Token ids and SamplingParams go in, Completions (token ids, logprobs, policy versions) come out,
exactly as from a local engine; plus the control endpoints a trainer needs (weights, pause, abort).
OpenAI-style text endpoints are for the official `openai` client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import httpx

from rollwise.types.generation import Completion, SamplingParams
from rollwise.serve.settings import client_auth_headers
from rollwise.types.routing import RoutedExperts
from rollwise.types.score import ScoreSequence


class EngineServerError(RuntimeError):
    """The server answered with an error; `message` names the offending field where there is one."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def read_response(response: httpx.Response, error: type[EngineServerError] = EngineServerError) -> Any:
    """The body of a rollwise server's answer (JSON, else text); an HTTP error raises `error` with the
    server's message (our servers answer errors as {"error": {"message": ...}})."""
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise error(response.status_code, message)
    return response.json() if "json" in response.headers.get("content-type", "") else response.text


class EngineClient:
    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        # a server with API keys gets the caller's $ROLLWISE_API_KEY (rollwise.serve.front)
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=client_auth_headers())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return read_response(self._http.request(method, path, json=body))

    def generate(
        self, prompt_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> list[Completion]:
        """All n samples of one prompt, ordered by index. `request_id` (optional) is what abort() takes."""
        body: dict[str, Any] = {"prompt_ids": list(prompt_ids), **asdict(params or SamplingParams())}
        if request_id is not None:
            body["request_id"] = request_id
        out = self._request("POST", "/generate", body)
        return [
            Completion(
                request_id=out["request_id"], index=c["index"], prompt_ids=out["prompt_ids"],
                token_ids=c["token_ids"], logprobs=c["logprobs"], versions=c["versions"],
                finish_reason=c["finish_reason"], cached_prompt_tokens=c["cached_prompt_tokens"],
                routed_experts=RoutedExperts.from_choice(c, f"choice {c['index']}"),
                migrations=[(str(s), str(t)) for s, t in c.get("migrations", [])],
            )
            for c in out["choices"]
        ]

    def score_tokens(self, sequences: Sequence[ScoreSequence], temperature: float = 1.0) -> list[list[float]]:
        """Engine.score_tokens over HTTP (POST /score, at most rollwise.engine.scoring.MAX_SCORE_SEQUENCES sequences):
        per sequence, the log-prob of each of token_ids[start:]."""
        body = {"sequences": [s.model_dump() for s in sequences], "temperature": temperature}
        return self._request("POST", "/score", body)["logprobs"]

    def model_info(self) -> dict[str, Any]:
        return self._request("GET", "/model_info")

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health")

    def metrics(self) -> str:
        return self._request("GET", "/metrics")

    def pause(self) -> None:
        self._request("POST", "/pause")

    def resume(self) -> None:
        self._request("POST", "/resume")

    def abort(self, request_id: str) -> int:
        """Abort a request in flight; returns how many of its samples were still running."""
        return self._request("POST", "/abort", {"request_id": request_id})["aborted_samples"]

    def update_weights_from_disk(self, path: str, version: int) -> dict[str, Any]:
        """Load a .safetensors file or HF model directory (a path on the server's machine)."""
        return self._request("POST", "/update_weights_from_disk", {"path": str(path), "version": version})
