"""Turn a stored message body back into the task's arguments, for display only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kombu.compression import decompress
from kombu.serialization import loads

#: Content types the admin decodes; pickle is never loaded just to show a row.
DISPLAY_CONTENT_TYPES = frozenset(
    {"application/json", "application/x-msgpack", "application/x-yaml"}
)


@dataclass(frozen=True)
class DecodedArguments:
    """A message's positional and keyword arguments, or why they cannot be shown."""

    args: list[Any]
    kwargs: dict[str, Any]
    error: str = ""


def decode_arguments(
    body: bytes,
    content_type: str,
    content_encoding: str,
    headers: Mapping[str, Any],
) -> DecodedArguments:
    """Decompress (per ``headers['compression']``) and deserialize a task message body.

    Protocol 2 bodies are ``[args, kwargs, embed]``; protocol 1 bodies are a dict with
    ``args`` and ``kwargs``. Never raises: a body that cannot be read gives ``error``.
    """
    if content_type not in DISPLAY_CONTENT_TYPES:
        return DecodedArguments(
            [], {}, f"not decoded: content type {content_type!r} is not shown here"
        )
    try:
        data = bytes(body)
        codec = headers.get("compression")
        if codec:
            data = decompress(data, codec)
        payload = loads(
            data, content_type, content_encoding, accept=DISPLAY_CONTENT_TYPES
        )
    except Exception as exc:
        return DecodedArguments([], {}, f"cannot decode: {type(exc).__name__}: {exc}")
    if isinstance(payload, (list, tuple)) and len(payload) >= 2:
        args, kwargs = payload[0], payload[1]
    elif isinstance(payload, Mapping):
        args, kwargs = payload.get("args", ()), payload.get("kwargs", {})
    else:
        return DecodedArguments([], {}, "cannot decode: unexpected message layout")
    args, kwargs = args or (), kwargs or {}
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, Mapping):
        # Not a Celery task body (sent with send_task to another consumer, say).
        return DecodedArguments(
            [],
            {},
            f"cannot decode: not a Celery task body (arguments "
            f"{type(args).__name__}, keyword arguments {type(kwargs).__name__})",
        )
    return DecodedArguments(list(args), dict(kwargs))
