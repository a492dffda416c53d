"""The SDK's error categories (`RequestErrorCategory`): a failed future answers
`{"error": message, "category": "user" | "server" | "unknown"}`. A `user` error means the request
itself is wrong (unknown loss, malformed tensors, a model the key does not own): the SDK does not
retry it, and nothing was applied."""

from __future__ import annotations

from typing import Literal

Category = Literal["user", "server", "unknown"]


class ServiceUserError(ValueError):
    """The caller's request is wrong; the message names the field and what to do."""

    category: Category = "user"
