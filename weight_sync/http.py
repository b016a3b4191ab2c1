"""Minimal JSON-over-HTTP calls to an SGLang server (stdlib only, so every layer can use it)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


class EngineHTTPError(RuntimeError):
    """An SGLang endpoint answered with an error or could not be reached."""


def _request(url: str, payload: dict | None, timeout_s: float):
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        url, data=data, method="GET" if payload is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:2000]
        raise EngineHTTPError(f"SGLang server request {url} answered HTTP {error.code}: {detail}") from error
    except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
        raise EngineHTTPError(f"SGLang server request {url} could not be reached: {error}") from error
    return json.loads(body) if body else None


def get_json(url: str, timeout_s: float = 30.0):
    return _request(url, None, timeout_s)


def post_json(url: str, payload: dict, timeout_s: float = 600.0):
    return _request(url, payload, timeout_s)
