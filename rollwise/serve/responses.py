"""JSON answers that are always valid JSON, even when a float is not finite.

Logprobs can be -inf (a token the sampler made impossible: min_tokens masking, extreme penalties) or NaN (a
degenerate distribution), and Python's json writes those as `-Infinity`/`NaN`, which JSON does not have; Starlette
refuses them and the client got a 500. Here -inf and +inf become -9999.0 and 9999.0 (vLLM's convention for
logprobs) and NaN becomes null.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse, Response

INF_LOGPROB = 9999.0


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced (dicts, lists and tuples walked)."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return INF_LOGPROB if value > 0 else -INF_LOGPROB
        return value
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:  # the common case, without walking the content
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
        except ValueError:
            return json.dumps(finite(content), ensure_ascii=False, allow_nan=False,
                              separators=(",", ":")).encode("utf-8")


def as_response(result: dict[str, Any] | Response) -> Response:
    """A handler's answer as a Response FastAPI sends as is: a dict returned to FastAPI goes through its
    jsonable_encoder first, which visits every token id and logprob again (the engine server's largest
    per-request cost on the event loop after uvicorn's own)."""
    return result if isinstance(result, Response) else FiniteJSONResponse(result)
