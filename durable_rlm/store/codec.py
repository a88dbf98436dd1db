"""Payload codecs: the claim check, then encryption.

Claim check: payloads over a threshold go to the blob store. History then holds a digest, so
its bytes per iteration stay bounded however large the prompts, responses and outputs get
(docs/architecture/index.md#invariants). Small payloads pass untouched, so short histories
replay without the blob store.

Encryption (DRLM_ENCRYPTION_KEYS, durable_rlm/store/encryption.py): every payload, claim-check
references included, is sealed with AES-256-GCM; the blobs are sealed by the blob store.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverter, PayloadCodec, PayloadConverter

from durable_rlm.store.blobs import BlobStore
from durable_rlm.store.encryption import Keyring, MissingKey

ENCRYPTED = b"binary/encrypted"
KEY_ID = "encryption-key-id"

ENCODING = b"binary/drlm-claim-check"
DEFAULT_THRESHOLD = 4 * 1024


class ClaimCheckCodec(PayloadCodec):
    def __init__(self, blobs: BlobStore, threshold: int = DEFAULT_THRESHOLD) -> None:
        self.blobs = blobs
        self.threshold = threshold

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [await self._encode_one(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [await self._decode_one(p) for p in payloads]

    async def _encode_one(self, payload: Payload) -> Payload:
        if payload.ByteSize() <= self.threshold:
            return payload
        digest = await asyncio.to_thread(self.blobs.put, payload.SerializeToString())
        return Payload(
            metadata={"encoding": ENCODING, "size": str(payload.ByteSize()).encode()},
            data=digest.encode(),
        )

    async def _decode_one(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        digest = payload.data.decode()
        data = self.blobs.cached(digest)  # hot: a payload this worker wrote or read recently
        if data is None:
            data = await asyncio.to_thread(self.blobs.get, digest)
        return Payload.FromString(data)


class EncryptionCodec(PayloadCodec):
    """Every payload sealed whole (its metadata too): history shows only the key id."""

    def __init__(self, keyring: Keyring | None) -> None:
        self.keyring = keyring

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if self.keyring is None:
            return list(payloads)
        keyring = self.keyring
        return [self._seal(keyring, p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if not any(p.metadata.get("encoding") == ENCRYPTED for p in payloads):
            return list(payloads)
        return (
            await asyncio.to_thread(self._open_all, payloads)
            if len(payloads) > 8
            else self._open_all(payloads)
        )

    def _open_all(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.open_payload(p) for p in payloads]

    @staticmethod
    def _seal(keyring: Keyring, payload: Payload) -> Payload:
        kid, sealed = keyring.encrypt(payload.SerializeToString())
        return Payload(metadata={"encoding": ENCRYPTED, KEY_ID: kid.encode()}, data=sealed)

    def open_payload(self, payload: Payload) -> Payload:
        if payload.metadata.get("encoding") != ENCRYPTED:
            return payload
        kid = payload.metadata.get(KEY_ID, b"").decode(errors="replace")
        if self.keyring is None:
            raise MissingKey(f"a payload is encrypted (key {kid!r}): set DRLM_ENCRYPTION_KEYS to read it")
        return Payload.FromString(self.keyring.decrypt(kid, payload.data))


class ChainCodec(PayloadCodec):
    """Codecs applied in order on the way out, in reverse on the way in."""

    def __init__(self, *codecs: PayloadCodec) -> None:
        self.codecs = codecs

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        out = list(payloads)
        for codec in self.codecs:
            out = await codec.encode(out)
        return out

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        out = list(payloads)
        for codec in reversed(self.codecs):
            out = await codec.decode(out)
        return out


def encrypts(converter: DataConverter) -> bool:
    codec = converter.payload_codec
    codecs = codec.codecs if isinstance(codec, ChainCodec) else (codec,)
    return any(isinstance(c, EncryptionCodec) and c.keyring is not None for c in codecs)


STACK_TRACE_CHARS = 900
"""A failure keeps its innermost frames up to this many characters: the server keeps at most
4 KB of a failure (message, stack traces and causes; it warns past 2 KB) and puts "Failure
exceeds size limit." in place of a larger one. The outer frames are the SDK's and the
worker's interceptors (each a frame or two), which say nothing about what failed."""
CUT_MARK = "  ... (outer frames cut)\n"


class BoundedFailureConverter(DefaultFailureConverter):
    """The SDK's failure converter, each stack trace in the chain cut to its innermost frames."""

    def to_failure(
        self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure
    ) -> None:
        super().to_failure(exception, payload_converter, failure)  # its causes through this method too
        failure.stack_trace = innermost_frames(failure.stack_trace)


def innermost_frames(stack_trace: str, limit: int = STACK_TRACE_CHARS) -> str:
    """The end of a formatted stack, from a frame's start, within `limit` characters."""
    if len(stack_trace) <= limit:
        return stack_trace
    tail = stack_trace[-limit:]
    start = tail.find('  File "')
    return CUT_MARK + (tail[start:] if start != -1 else tail)


def data_converter(
    blobs: BlobStore | None, threshold: int = DEFAULT_THRESHOLD, keyring: Keyring | None = None
) -> DataConverter:
    """The project's converter: pydantic v2 models, the claim check when a store is given,
    then encryption. Without a keyring, encrypted payloads are still recognised (and refused
    with the reason), so a process lacking the keys says so instead of failing oddly."""
    codecs: list[PayloadCodec] = []
    if blobs is not None:
        codecs.append(ClaimCheckCodec(blobs, threshold))
    codecs.append(EncryptionCodec(keyring))
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=ChainCodec(*codecs),
        failure_converter_class=BoundedFailureConverter,
    )
