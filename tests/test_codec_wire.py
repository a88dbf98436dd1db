"""The codec server's payloads as proto3 JSON (durable_rlm/viewer/codec_wire.py): read in either
base64, every malformed body named for what is wrong, written with metadata and data always
present. Through a real server: tests/test_codec_requests.py."""

from __future__ import annotations

import json

import pytest
from temporalio.api.common.v1 import Payload

from durable_rlm.viewer.codec_wire import BadRequest, payloads_from_json, payloads_to_json


def test_payloads_read_from_proto3_json_in_either_base64() -> None:
    (payload,) = payloads_from_json(
        json.dumps(
            {"payloads": [{"metadata": {"encoding": "anNvbi9wbGFpbg", "k": "-_8"}, "data": "IjEi"}]}
        ).encode()
    )
    assert payload.metadata["encoding"] == b"json/plain" and payload.metadata["k"] == b"\xfb\xff"
    assert payload.data == b'"1"'
    (empty,) = payloads_from_json(b'{"payloads": [{"metadata": null, "data": null}]}')
    assert empty == Payload()
    (spaced,) = payloads_from_json(b'{"payloads": [{"data": " IjEi "}]}')
    assert spaced.data == b'"1"'


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            b"{",
            "the body is not JSON: Expecting property name enclosed in double quotes: line 1 column 2",
        ),
        (
            b'{"payloads": {}}',
            'the body must be a JSON object {"payloads": [{"metadata": {...}, "data": "..."}]}',
        ),
        (b'{"payloads": [{}, 1]}', "payload 1 is not a JSON object"),
        (b'{"payloads": [{"metadata": "x"}]}', "payload 0: metadata must be an object of base64 strings"),
        (b'{"payloads": [{"data": 5}]}', "payload 0: data must be a base64 string, not int"),
        (b'{"payloads": [{"data": "a"}]}', "payload 0: data is not base64"),
        (
            b'{"payloads": [{"metadata": {"k": []}}]}',
            "payload 0: metadata 'k' must be a base64 string, not list",
        ),
        (
            b'{"payloads": [{"metadata": {"encoding": "AAE="}}]}',
            "payload 0: metadata 'encoding' is not base64 of a name: metadata values are base64 in proto3 "
            "JSON (json/plain is anNvbi9wbGFpbg==)",
        ),
        (
            b'{"payloads": [{"metadata": {"encoding": "w6k="}}]}',  # a name, but not ASCII
            "payload 0: metadata 'encoding' is not base64 of a name",
        ),
    ],
)
def test_a_body_that_is_not_payloads_says_what_is_wrong(body: bytes, error: str) -> None:
    with pytest.raises(BadRequest) as refused:
        payloads_from_json(body)
    assert str(refused.value).startswith(error)


def test_payloads_written_to_json_always_have_metadata_and_data() -> None:
    assert payloads_to_json([Payload(), Payload(metadata={"a": b"\xff"}, data=b"xy")]) == {
        "payloads": [
            {"metadata": {}, "data": ""},
            {"metadata": {"a": "/w=="}, "data": "eHk="},
        ]
    }
