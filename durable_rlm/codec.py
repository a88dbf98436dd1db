"""Claim-check payload codec: payloads over a threshold go to the blob store.

History then holds a digest, so its bytes per iteration stay bounded however large the
prompts, responses and outputs get (DESIGN invariant 5). Small payloads pass untouched, so
short histories replay without the blob store.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, PayloadCodec

from durable_rlm.blobs import BlobStore

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


def data_converter(blobs: BlobStore | None, threshold: int = DEFAULT_THRESHOLD) -> DataConverter:
    """The project's converter: pydantic v2 models, plus the claim check when a store is given."""
    if blobs is None:
        return pydantic_data_converter
    return dataclasses.replace(pydantic_data_converter, payload_codec=ClaimCheckCodec(blobs, threshold))
