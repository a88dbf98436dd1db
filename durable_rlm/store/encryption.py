"""Payload and blob encryption at rest: AES-256-GCM, keys from settings, a key id in each.

With DRLM_ENCRYPTION_KEYS set, every payload a client or worker hands to Temporal is
encrypted (durable_rlm/store/codec.py: `EncryptionCodec`, after the claim check), and every blob
is encrypted before it is stored (`Keyring.seal`, in durable_rlm/store/blobs.py): histories and
stores then hold no clear prompt, output or context. The first key encrypts; every key listed decrypts, so a
key is rotated by putting the new one first and keeping the old ones until nothing written
with them is read any more.

    DRLM_ENCRYPTION_KEYS="k2=BASE64-32-BYTES,k1=BASE64-32-BYTES"
    python -c "import base64, os; print(base64.b64encode(os.urandom(32)).decode())"

A blob keeps its address, the sha256 of its clear content: two equal blobs are stored once,
and whoever can guess a content can confirm it by its digest (its bytes stay sealed).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from typing import Any

from durable_rlm.errors import ConfigurationError

BLOB_MAGIC = b"drlm-aes256gcm:"  # a sealed blob: magic, key id, ':', nonce, ciphertext+tag
NONCE_BYTES = 12
_KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class MissingKey(ConfigurationError):
    """Something was encrypted with a key this process does not have."""


class Keyring:
    """The keys of DRLM_ENCRYPTION_KEYS: `current` encrypts, all decrypt."""

    def __init__(self, keys: dict[str, bytes], current: str) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # start-up: 0.04 s, drlm list skips

        self.keys: dict[str, Any] = {kid: AESGCM(key) for kid, key in keys.items()}
        self.current = current

    @classmethod
    def parse(cls, text: str) -> Keyring:
        """'id=base64,id=base64': a bad entry is a ConfigurationError naming the variable
        and the entry's position, never the key."""
        keys: dict[str, bytes] = {}
        order: list[str] = []
        for position, entry in enumerate((e.strip() for e in text.split(",")), start=1):
            if not entry:
                continue
            kid, sep, encoded = entry.partition("=")
            kid = kid.strip()
            where = f"DRLM_ENCRYPTION_KEYS: key {position}"
            if not sep or not _KEY_ID.match(kid):
                raise ConfigurationError(
                    f"{where} is not ID=BASE64 with an ID of letters, digits, '.', '_', '-'"
                )
            try:
                key = base64.b64decode(encoded.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise ConfigurationError(f"{where} ({kid}) is not base64") from None
            if len(key) != 32:
                raise ConfigurationError(f"{where} ({kid}) is {len(key)} bytes; AES-256 needs 32")
            if kid in keys:
                raise ConfigurationError(f"{where}: the id {kid} is listed twice")
            keys[kid] = key
            order.append(kid)
        if not order:
            raise ConfigurationError("DRLM_ENCRYPTION_KEYS names no key")
        return cls(keys, order[0])

    def encrypt(self, plaintext: bytes, associated: bytes = b"") -> tuple[str, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        return self.current, nonce + self.keys[self.current].encrypt(nonce, plaintext, associated)

    def decrypt(self, kid: str, sealed: bytes, associated: bytes = b"", what: str = "a payload") -> bytes:
        cipher = self.keys.get(kid)
        if cipher is None:
            raise MissingKey(
                f"{what} is encrypted with key {kid!r}, which DRLM_ENCRYPTION_KEYS does not hold "
                f"(it holds {', '.join(sorted(self.keys))})"
            )
        from cryptography.exceptions import InvalidTag  # start-up: cryptography, as in __init__

        try:
            return cipher.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
        except InvalidTag:
            raise ValueError(f"{what} failed its integrity check under key {kid!r}") from None

    # --- blobs ------------------------------------------------------------------------------

    def seal(self, digest: str, data: bytes) -> bytes:
        """A blob as stored: bound to its address, so a sealed blob cannot pass for another."""
        kid, sealed = self.encrypt(data, digest.encode())
        return BLOB_MAGIC + kid.encode() + b":" + sealed

    def open(self, digest: str, stored: bytes) -> bytes:
        return open_blob(self, digest, stored)


def open_blob(keyring: Keyring | None, digest: str, stored: bytes) -> bytes:
    """A blob's clear content: unsealed with its key, or as stored when it was written in the
    clear (a store from before encryption was turned on)."""
    if not stored.startswith(BLOB_MAGIC):
        return stored
    kid, _, sealed = stored[len(BLOB_MAGIC) :].partition(b":")
    if keyring is None:
        raise MissingKey(
            f"blob {digest} is encrypted (key {kid.decode(errors='replace')!r}): set DRLM_ENCRYPTION_KEYS"
        )
    return keyring.decrypt(kid.decode(errors="replace"), sealed, digest.encode(), what=f"blob {digest}")
