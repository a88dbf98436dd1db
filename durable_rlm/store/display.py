"""Payloads as a person reads them: claim-check references replaced by their content.

The claim-check codec (codec.py) leaves a digest in history for every payload over 4 KB; a
reader (the Web UI's codec endpoint, `drlm show`, the audit rebuild) wants the content.
Reading never fails a whole batch for one payload: a blob too large to display is shortened
(and says so, with its size and digest), a blob that cannot be read becomes a readable
placeholder, and payloads sealed with DRLM_ENCRYPTION_KEYS are opened with the store's keys
(a placeholder says which key is missing). Part of the storage library: it knows payloads
and blobs, nothing of who shows them (durable_rlm/viewer/codec_server.py serves them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import Payload

from durable_rlm.store.blobs import BlobNotFound, BlobStore
from durable_rlm.store.codec import (
    ENCODING,
    ENCRYPTED,
    KEY_ID,
    EncryptionCodec,
)
from durable_rlm.store.encryption import MissingKey

log = logging.getLogger(__name__)

DISPLAY_LIMIT = 64 * 1024  # bytes of one decoded payload's data the UI is given, at most
JSON_PLAIN = b"json/plain"


def decode_payloads(
    payloads: Sequence[Payload], blobs: BlobStore, limit: int | None = DISPLAY_LIMIT, previews: bool = True
) -> list[Payload]:
    """Payloads as a reader should see them: claim-check references replaced by their
    content, content over `limit` bytes shortened (None: whole), unreadable blobs replaced by
    a JSON placeholder naming the digest and the store. Other payloads pass unchanged.

    Never raises for a payload's content: one bad reference must not hide a whole event."""
    decoded = [_decode_guarded(payload, blobs, limit) for payload in payloads]
    return [_with_contexts(payload, blobs) for payload in decoded] if previews else decoded


def as_lines(payload: Payload) -> Payload:
    """For a person's eyes only (the Web UI, `temporal ... --codec-endpoint`): every string
    with a line break becomes the list of its lines. The UI shows a payload as JSON, where a
    model's reply or a cell's code is one string full of `\\n`; a list of lines reads as
    the text. Marked `drlm-display: lines`; never what a worker reads (workers decode with
    their own codec, not this server)."""
    if payload.metadata.get("encoding") != JSON_PLAIN or b"\\n" not in payload.data:
        return payload
    if len(payload.data) > DISPLAY_LIMIT:
        return payload
    try:
        value = json.loads(payload.data)
    except ValueError:
        return payload
    out = Payload()
    out.CopyFrom(payload)
    out.data = json.dumps(_split_lines(value), ensure_ascii=False).encode("utf-8")
    out.metadata["drlm-display"] = b"lines"
    return out


def _split_lines(value: Any, depth: int = 0) -> Any:
    if isinstance(value, str):
        return value.split("\n") if "\n" in value else value
    if depth > 16:
        return value
    if isinstance(value, dict):
        return {key: _split_lines(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_split_lines(item, depth + 1) for item in value]
    return value


def unreadable(payload: Payload) -> str | None:
    """The placeholder's text, if `decode_payloads` could not read this payload."""
    if payload.metadata.get("drlm-error") != b"true":
        return None
    return str(json.loads(payload.data))


CONTEXT_PREVIEW = 4_000  # characters of an episode's context shown beside its reference


def _with_contexts(payload: Payload, blobs: BlobStore) -> Payload:
    """A request names its context by digest (`{"digest": "sha256:…", "kind": "text", ...}`):
    for a reader, put the start of the context beside it (`"preview"`)."""
    if payload.metadata.get("encoding") != JSON_PLAIN or b'"kind"' not in payload.data:
        return payload
    if len(payload.data) > DISPLAY_LIMIT or b'"sha256' not in payload.data:
        return payload
    try:
        value = json.loads(payload.data)
    except ValueError:
        return payload
    if not _add_previews(value, blobs, budget=[8]):
        return payload
    out = Payload()
    out.CopyFrom(payload)
    out.data = json.dumps(value, ensure_ascii=False).encode("utf-8")
    return out


def _add_previews(value: Any, blobs: BlobStore, budget: list[int], depth: int = 0) -> bool:
    """Walk (bounded: depth 8, at most `budget` contexts) and add previews in place."""
    if depth > 8 or budget[0] <= 0:
        return False
    changed = False
    if isinstance(value, dict):
        digest = value.get("digest")
        if isinstance(digest, str) and digest.startswith("sha256") and value.get("kind") in ("text", "json"):
            budget[0] -= 1
            try:
                # The head only: a context of gigabytes is never read whole for a preview.
                head = blobs.head(digest, CONTEXT_PREVIEW * 4)
                text = head.decode("utf-8", errors="ignore")[:CONTEXT_PREVIEW]
                size = value.get("size")
                cut = size - len(text) if isinstance(size, int) else 0
                value["preview"] = text + (f"… [{cut} more characters]" if cut > 0 else "")
            except Exception as exc:  # noqa: BLE001 - a missing context must not hide the event
                value["preview"] = f"[context {digest} unreadable: {str(exc).splitlines()[0][:200]}]"
            return True
        for item in value.values():
            changed = _add_previews(item, blobs, budget, depth + 1) or changed
    elif isinstance(value, list):
        for item in value[:100]:
            changed = _add_previews(item, blobs, budget, depth + 1) or changed
    return changed


def _decode_guarded(payload: Payload, blobs: BlobStore, limit: int | None) -> Payload:
    try:
        return _decode_one(payload, blobs, limit)
    except Exception as exc:  # a bug here must still leave the rest of the event readable
        log.exception("display: cannot decode a payload")
        digest = payload.data.decode("utf-8", errors="replace")[:80]
        return _placeholder(f"[cannot decode claim-checked payload {digest}: {type(exc).__name__}]", digest)


def _decode_one(payload: Payload, blobs: BlobStore, limit: int | None) -> Payload:
    if payload.metadata.get("encoding") == ENCRYPTED:
        # Sealed with DRLM_ENCRYPTION_KEYS: opened with the keys this server's store has.
        kid = payload.metadata.get(KEY_ID, b"").decode(errors="replace")
        try:
            payload = EncryptionCodec(blobs.keyring).open_payload(payload)
        except MissingKey as exc:
            return _placeholder(f"[encrypted payload: {exc}]", f"key {kid}")
    if payload.metadata.get("encoding") != ENCODING:
        return payload
    digest = payload.data.decode("utf-8", errors="replace")
    size = payload.metadata.get("size", b"?").decode("ascii", errors="replace")
    try:
        inner = Payload.FromString(blobs.get(digest))
    except BlobNotFound:
        message = str(BlobNotFound(digest, store_name(blobs)))
        return _placeholder(f"[claim-checked payload of {size} bytes: {message}]", digest)
    except (ValueError, DecodeError) as exc:  # a malformed digest, a corrupt blob
        return _placeholder(f"[claim-checked payload {digest} of {size} bytes is unreadable: {exc}]", digest)
    except Exception as exc:  # the store itself: the database is down, a permission
        log.warning("display: cannot read blob %s: %s", digest, exc)
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return _placeholder(
            f"[cannot read claim-checked payload {digest} from {store_name(blobs)}: {reason}]", digest
        )
    if limit is not None and len(inner.data) > limit:
        return _shorten(inner, digest, limit)
    return inner


def store_name(blobs: BlobStore) -> str:
    """Where the blobs are read from, for messages (no password)."""
    if blobs.where:
        return blobs.where
    return blobs.backend.describe()


def _placeholder(text: str, digest: str) -> Payload:
    return Payload(
        metadata={"encoding": JSON_PLAIN, "drlm-digest": digest.encode(), "drlm-error": b"true"},
        data=json.dumps(text).encode(),
    )


def _shorten(inner: Payload, digest: str, limit: int) -> Payload:
    """JSON stays JSON (the UI parses it): its long strings are cut in the middle until it
    fits, and a note says what was left out; anything else becomes a string of its head."""
    size = len(inner.data)
    note = (
        f"shortened for display by the drlm codec server: the whole payload is {size:,} bytes, blob {digest}"
    )
    encoding = inner.metadata.get("encoding", b"")
    data: bytes | None = None
    if encoding.startswith(b"json/"):
        try:
            data = _fit_json(json.loads(inner.data), note, limit)
        except (ValueError, RecursionError):  # not JSON after all, or nested too deep
            data = None
    if data is None:  # not JSON, or JSON that no amount of string cutting fits
        data = _head_as_string(inner.data.decode("utf-8", errors="replace"), note, limit)
    metadata = {k: v for k, v in inner.metadata.items() if k not in ("encoding", "messageType")}
    metadata.update(
        {
            "encoding": JSON_PLAIN,
            "drlm-shortened": b"true",
            "drlm-size": str(size).encode(),
            "drlm-digest": digest.encode(),
        }
    )
    return Payload(metadata=metadata, data=data)


def _head_as_string(text: str, note: str, limit: int) -> bytes:
    prefix = f"[{note}; its first part follows] "
    keep = max(limit - len(prefix) - 2, 0)
    while True:
        data = _utf8(json.dumps(prefix + text[:keep], ensure_ascii=False))
        if len(data) <= limit or keep == 0:
            return data
        keep = max(keep - (len(data) - limit), 0)  # each character dropped saves a byte or more


def _fit_json(value: Any, note: str, limit: int) -> bytes | None:
    cap = max(limit // 2, 256)
    while cap >= 64:
        shortened = _cut_strings(value, cap)
        if isinstance(shortened, dict):
            shortened = {"drlm_codec_note": note, **shortened}
        else:
            shortened = {"drlm_codec_note": note, "value": shortened}
        data = _utf8(json.dumps(shortened, ensure_ascii=False))
        if len(data) <= limit:
            return data
        cap //= 2
    return None


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", errors="replace")  # JSON may hold a lone surrogate (escaped)


def _cut_strings(value: Any, cap: int) -> Any:
    if isinstance(value, str):
        if len(value) <= cap:
            return value
        keep = cap // 2
        left_out = f"[{len(value) - 2 * keep:,} of {len(value):,} characters left out]"
        return f"{value[:keep]} … {left_out} … {value[-keep:]}"
    if isinstance(value, dict):
        return {k: _cut_strings(v, cap) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_strings(v, cap) for v in value]
    return value
