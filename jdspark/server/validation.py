"""The edge: a request body read within a size limit, and its JSON decoded within limits.

`read_body` runs in the event loop and refuses a body over the limit (413) from its Content-Length
or while it streams in, before anything is parsed. `decode_json` is CPU work and runs in a worker
thread: it refuses what is not JSON, nesting deeper than the limit, numbers that are not finite
(`NaN`, `Infinity`, `1e999`) and text that cannot be UTF-8 (a lone or reversed UTF-16 surrogate
written as `\\ud800`); each a 400 that names the problem and, for a value, its field.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.requests import Request

from jdspark.server.errors import APIError

MAX_BODY_BYTES = 8 * 2 ** 20  # enough for a prompt that fills a long context
MAX_JSON_DEPTH = 64  # objects and arrays inside each other (tool schemas nest; nothing needs more)


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body ({size} bytes or more) exceeds the server's limit of {limit} bytes",
                    code="request_too_large")


def decode_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON value of `raw` (UTF-8), checked for depth, for numbers that are not finite and for
    text that is not valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise nesting_error(max_depth) from None
    except ValueError as e:  # also UnicodeDecodeError: the body is not UTF-8
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    check_tree(body, max_depth)
    return body


def nesting_error(max_depth: int) -> APIError:
    return APIError(400, f"the request body nests objects and arrays deeper than {max_depth} levels",
                    code="json_too_deep")


def _valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def check_tree(value: Any, max_depth: int) -> None:
    """Walk the decoded JSON (no recursion): a 400 for nesting deeper than `max_depth`, for a number
    that is not finite, or for a key or string that is not valid Unicode (param: its path, e.g.
    `messages.0.content`)."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if not _valid_text(node):
                raise surrogate_error(path)
        elif isinstance(node, float):
            if not math.isfinite(node):
                param = _param(path)
                raise APIError(400, f"'{param}': {node} is not a finite number", param=param, code="finite_number")
        elif isinstance(node, (dict, list)):
            if depth >= max_depth:
                raise nesting_error(max_depth)
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for key, child in items:
                if isinstance(key, str) and not _valid_text(key):
                    raise surrogate_error(path)
                stack.append((child, (*path, key), depth + 1))


def _param(path: tuple) -> str | None:
    return ".".join(str(p) for p in path if _valid_text(str(p))) or None


def surrogate_error(path: tuple) -> APIError:
    param = _param(path)
    return APIError(400, f"'{param}' holds a lone or reversed UTF-16 surrogate (e.g. \\ud800): text must be valid "
                    "Unicode", param=param, code="invalid_unicode")
