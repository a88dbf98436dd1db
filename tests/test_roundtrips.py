"""Properties of what crosses a boundary and must come back as it went: the claim-check codec
(history holds a digest, the worker gets the payload) and the typed cell log (the REPL
rebuild and extraction read exactly the cells that were written)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from temporalio.api.common.v1 import Payload

from durable_rlm.store import chains
from durable_rlm.store.blobs import BlobStore, DirectoryBackend
from durable_rlm.store.codec import ENCODING, ClaimCheckCodec

THRESHOLD = 256
_STORE = BlobStore(DirectoryBackend(Path(tempfile.mkdtemp(prefix="drlm-roundtrip-")) / "blobs"))

payloads = st.builds(
    lambda data, encoding: Payload(metadata={"encoding": encoding}, data=data),
    st.binary(max_size=2 * THRESHOLD),
    st.sampled_from([b"json/plain", b"binary/null", b"json/protobuf"]),  # what the converter emits
)


@given(st.lists(payloads, max_size=4))
def test_the_codec_gives_back_every_payload_and_keeps_only_small_ones_in_history(
    sent: list[Payload],
) -> None:
    codec = ClaimCheckCodec(_STORE, threshold=THRESHOLD)
    encoded = asyncio.run(codec.encode(sent))
    for original, stored in zip(sent, encoded, strict=True):
        if original.ByteSize() <= THRESHOLD:
            assert stored == original  # small payloads pass untouched: they replay without a store
        else:
            assert stored.metadata["encoding"] == ENCODING and stored.ByteSize() < 200
    assert asyncio.run(codec.decode(encoded)) == sent


texts = st.text(max_size=60)
answers = st.builds(
    chains.LoggedAnswer,
    call=st.integers(0, 50),
    prompt=texts,
    ok=st.booleans(),
    text=texts,
    kind=st.sampled_from(["llm_query", "llm_query_batched"]),
)
cells = st.tuples(
    texts,
    st.lists(st.lists(answers, min_size=1, max_size=3), max_size=3),
    st.sampled_from(["ok", "error", "timeout", "killed", "lost", None]),
    st.one_of(st.none(), texts),
)


@given(st.lists(cells, max_size=6))
def test_the_cell_log_reads_back_the_cells_that_were_written(written: list) -> None:
    head = None
    for index, (code, batches, status, output) in enumerate(written):
        head = chains.append(_STORE, head, chains.CellStarted(cell=index, iteration=index + 1, code=code))
        for batch in batches:
            head = chains.append(_STORE, head, chains.CallsAnswered(cell=index, answers=batch))
        if status is not None:
            head = chains.append(_STORE, head, chains.CellEnded(cell=index, status=status, output=output))
    log = chains.read_cell_log(_STORE, head)
    assert [(c.index, c.iteration, c.code) for c in log.cells] == [
        (i, i + 1, code) for i, (code, _, _, _) in enumerate(written)
    ]
    for cell, (_, batches, status, output) in zip(log.cells, written, strict=True):
        assert cell.answers == [answer for batch in batches for answer in batch]
        assert (cell.status, cell.output) == (status, output if status is not None else None)
