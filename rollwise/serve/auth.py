"""API keys and per-key quotas for rollwise's HTTP servers: who may use a server at all, and how much of it.

A key says who may come in (e.g. attach a job to the pool); what a caller then holds is guarded by its own
secret (the pool's job tokens). Keys come from a file (`--api-keys FILE`: one key per line, `#` starts a
comment) or from the environment (`ROLLWISE_API_KEYS=key1,key2`); a client sends `Authorization: Bearer KEY`
(rollwise's clients read their key from `ROLLWISE_API_KEY`). The sent key is compared with every configured
key in constant time (hmac.compare_digest, no early exit), so the time a refusal takes says nothing about
which key, or how much of one, was right. A refusal is a 401 in the servers' error envelope
(rollwise.serve.errors) saying what to send. Keys are never logged or echoed: quotas and reports know a key by
its label, a short hash of it.

`ApiKeys.check` / `caller_dependency(keys)` (a FastAPI dependency returning the caller's label; with no keys
configured every caller is `ANONYMOUS`), `KeyQuota` (what each label holds against a per-key and a total limit:
429 with Retry-After), `load_api_keys` (file or environment) and `is_loopback` (whether running without keys
is acceptable for a bind address) are shared by every server; nothing here knows what a server serves.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rollwise.serve.errors import APIError
from rollwise.serve.settings import CLIENT_KEY_ENV, KEYS_ENV

MIN_KEY_CHARS = 16
ANONYMOUS = "anonymous"  # the label of every caller of a server that has no keys
CALLER_STATE = "rollwise_caller"  # request.state key under which the gate leaves the caller's label
MAKE_KEY = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def _checked(key: str, where: str) -> str:
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{where}: an API key must have at least {MIN_KEY_CHARS} characters (this one has "
                         f"{len(key)}); make one with {MAKE_KEY}")
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{where}: an API key must be printable ASCII without spaces (it travels in an HTTP "
                         f"header); make one with {MAKE_KEY}")
    return key


class ApiKeys:
    """The keys a server accepts. `source` (a file or variable name) is what its messages point to."""

    def __init__(self, keys: Iterable[str], source: str, origins: Iterable[str] | None = None) -> None:
        keys = list(keys)
        unique = list(dict.fromkeys(keys))
        if not unique:
            raise ValueError(f"{source}: no API keys in it; put one key per line (make one with {MAKE_KEY})")
        self._keys = tuple(k.encode() for k in unique)
        self.source = source
        # where each key was given ("--api-keys FILE, line 3"): what a server's own key rules point to
        where = list(origins) if origins is not None else [source] * len(keys)
        self._origins: dict[str, str] = {}
        for key, at in zip(keys, where):
            self._origins.setdefault(key, at)  # a repeated key: where it was first given

    def origins_where(self, bad: Callable[[str], bool]) -> list[str]:
        """Where each key for which `bad(key)` holds was given (file line or variable position), in order."""
        return [at for key, at in self._origins.items() if bad(key)]

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """One key per line; blank lines and `#` comments (whole lines, or after the key) are skipped (so a key
        cannot hold `#`; secrets.token_urlsafe keys never do)."""
        where = f"--api-keys {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file; write one key per line into it") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: cannot read it as a UTF-8 text file of keys ({exc.__class__.__name__}: "
                             f"{exc})") from None
        keys, origins = [], []
        for number, line in enumerate(text.splitlines(), 1):
            content = line.split("#", 1)[0].strip()
            if content:
                keys.append(_checked(content, f"{where}, line {number}"))
                origins.append(f"{where}, line {number}")
        return cls(keys, where, origins)

    @classmethod
    def from_env(cls, value: str, var: str = KEYS_ENV) -> ApiKeys:
        keys = [k.strip() for k in value.split(",") if k.strip()]
        return cls([_checked(k, f"{var} (key {i + 1})") for i, k in enumerate(keys)], var,
                   [f"{var} (key {i + 1})" for i in range(len(keys))])

    def __len__(self) -> int:
        return len(self._keys)

    @staticmethod
    def label(key: bytes) -> str:
        """How quotas and reports name a key (never the key itself)."""
        return "key-" + hashlib.sha256(key).hexdigest()[:10]

    def check(self, token: str | None) -> str:
        """The label of the key `token` is, or a 401 saying what to send."""
        sent = (token or "").encode("utf-8", "replace")
        found: bytes | None = None
        for key in self._keys:  # every key, no early exit: the time taken does not depend on which one matched
            if hmac.compare_digest(key, sent):
                found = key
        if found is None:
            what = "this API key is not one of the server's keys" if token else "this server needs an API key"
            raise APIError(401, f"{what}: send `Authorization: Bearer KEY` (or `X-API-Key: KEY`) with a key from "
                                f"the server's {self.source} (rollwise's clients read it from {CLIENT_KEY_ENV})",
                           "authorization", "authentication_error", "invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return self.label(found)


def caller_dependency(keys: ApiKeys | None) -> Callable[..., str]:
    """A FastAPI dependency (`Depends(caller_dependency(keys))`) returning the caller's key label (`ANONYMOUS` for
    every caller when `keys` is None); it declares the bearer scheme in the OpenAPI schema. Behind the gate
    (rollwise.serve.gate, on every server) the key was checked there: its label is read from the request's
    state rather than compared against every key a second time."""
    bearer = HTTPBearer(auto_error=False, description=f"an API key of the server's ({KEYS_ENV} or --api-keys)")

    def caller(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
        if keys is None:
            return ANONYMOUS
        checked = getattr(request.state, CALLER_STATE, None)
        return checked if checked is not None else keys.check(credentials.credentials if credentials else None)

    return caller


def load_api_keys(file: str | Path | None, environ: Mapping[str, str] = os.environ) -> ApiKeys | None:
    """The server's keys: from `file` if given, else from ROLLWISE_API_KEYS if set; None: no keys."""
    if file is not None:
        return ApiKeys.from_file(file)
    value = environ.get(KEYS_ENV)
    if value is not None and value.strip():
        return ApiKeys.from_env(value)
    return None


def is_loopback(host: str) -> bool:
    """True if binding `host` accepts connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeyQuota:
    """How many of something (jobs, sessions) each key label holds, against a per-key and a total limit.
    `acquire` counts one or refuses with 429 and Retry-After; `release` gives one back. Thread-safe."""

    def __init__(self, per_key: int, total: int, what: str = "jobs", per_key_option: str = "--max-jobs-per-key",
                 total_option: str = "--max-jobs", retry_after_s: float = 30.0, how_to_free: str = "") -> None:
        if total < 1:
            raise ValueError(f"{total_option} must be >= 1, got {total}")
        if per_key < 1:
            raise ValueError(f"{per_key_option} must be >= 1, got {per_key}")
        self.per_key, self.total, self.what = per_key, total, what
        self.per_key_option, self.total_option = per_key_option, total_option
        self.retry_after_s, self.how_to_free = retry_after_s, how_to_free
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, label: str) -> None:
        with self._lock:
            mine, everyone = self._held.get(label, 0), sum(self._held.values())
            if everyone >= self.total:
                self._refuse(f"the server holds {everyone} {self.what}, its limit ({self.total_option}={self.total})")
            if mine >= self.per_key:
                self._refuse(f"this API key holds {mine} {self.what}, the limit per key "
                             f"({self.per_key_option}={self.per_key})")
            self._held[label] = mine + 1

    def release(self, label: str) -> None:
        with self._lock:
            left = self._held.get(label, 0) - 1
            if left > 0:
                self._held[label] = left
            else:
                self._held.pop(label, None)

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def _refuse(self, why: str) -> None:
        raise APIError(429, f"too many {self.what}: {why}{'; ' + self.how_to_free if self.how_to_free else ''}",
                       None, "rate_limit_error", "quota_exceeded",
                       headers={"Retry-After": str(max(1, round(self.retry_after_s)))})
