"""Temporal's remote codec protocol on the wire: payloads as proto3 JSON, checked as they are
read (a request names what it holds; nothing of it is trusted)."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable
from typing import Any

from temporalio.api.common.v1 import Payload

MAX_BODY = 32 * 1024 * 1024  # a request body over this is refused (413), not read
ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"  # what the Web UI sends


class BadRequest(ValueError):
    """A request body we cannot read; its message goes back to the caller as a 400."""


def payloads_from_json(body: bytes) -> list[Payload]:
    """The `{"payloads": [...]}` body the Web UI and CLI send, as Payloads (proto3 JSON)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("payloads"), list):
        raise BadRequest('the body must be a JSON object {"payloads": [{"metadata": {...}, "data": "..."}]}')
    return [_payload_from_json(index, item) for index, item in enumerate(document["payloads"])]


def _payload_from_json(index: int, item: Any) -> Payload:
    if not isinstance(item, dict):
        raise BadRequest(f"payload {index} is not a JSON object")
    metadata = item.get("metadata")
    metadata = {} if metadata is None else metadata  # proto3 JSON: null is the default
    if not isinstance(metadata, dict):
        raise BadRequest(f"payload {index}: metadata must be an object of base64 strings")
    data = item.get("data")
    payload = Payload(data=b"" if data is None else _base64(data, f"payload {index}: data"))
    for key, value in metadata.items():
        payload.metadata[key] = _base64(value, f"payload {index}: metadata {key!r}")
    encoding = payload.metadata.get("encoding")
    if encoding is not None and not (encoding.isascii() and encoding.decode("ascii").isprintable()):
        # The usual mistake: `"encoding": "json/plain"` instead of its base64, which decodes
        # (base64 is lax) to bytes that match no codec, and the payload passes undecoded.
        raise BadRequest(
            f"payload {index}: metadata 'encoding' is not base64 of a name: metadata values are "
            "base64 in proto3 JSON (json/plain is anNvbi9wbGFpbg==)"
        )
    return payload


def _base64(value: Any, what: str) -> bytes:
    """Proto3 JSON bytes: standard or URL-safe base64, padded or not."""
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a base64 string, not {type(value).__name__}")
    text = value.strip().replace("-", "+").replace("_", "/")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        raise BadRequest(f"{what} is not base64") from None


def payloads_to_json(payloads: Iterable[Payload]) -> dict[str, list[dict[str, Any]]]:
    """Payloads in proto3 JSON, always with `metadata` and `data` (the UI looks for both)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode("ascii")

    return {
        "payloads": [
            {"metadata": {k: b64(v) for k, v in p.metadata.items()}, "data": b64(p.data)} for p in payloads
        ]
    }


# --- the server ---------------------------------------------------------------------------
