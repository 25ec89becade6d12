"""The local protocol's request records (birdnet.requests), shared by the client and the daemon:
what the client builds decodes to the same record on the daemon's side, and a bad field is refused
once, at decoding, with an error naming the request and the field."""
from __future__ import annotations

import subprocess
import sys

import pytest

from birdnet import PROTOCOL_VERSION
from birdnet.errors import InputError, ProtocolError
from birdnet.requests import (
    ANONYMOUS_PREFIX,
    MAX_PID,
    MAX_SLOTS,
    REQUESTS,
    Alloc,
    Bye,
    Hello,
    Status,
    Submit,
    Warm,
    anonymous_name,
    decode,
)

GOOD = [
    Hello(job="j", pid=42, proto=PROTOCOL_VERSION, door=True, local_rank=1),
    Hello(job="j", pid=42, proto=PROTOCOL_VERSION),
    Alloc(slot=3, nbytes=4096, call=7),
    Submit(seq=5, kind="allreduce", call=9, door=True, name="layer1.w", shape=[4, 2], dtype="float32", slot=0,
           op="mean", root=0, codec="birdplus", params={"density": 0.01}),
    Submit(seq=6, kind="barrier", call=10),
    Status(call=11),
    Warm(codec="qsgd", params={"levels": 3}, call=12),
    Bye(call=13),
]


@pytest.mark.parametrize("record", GOOD, ids=lambda r: r.t)
def test_records_round_trip_through_their_headers(record):
    header = record.header()
    assert header["t"] == record.t
    assert None not in header.values()  # fields not set are absent, as in the hand-built dicts before
    assert decode(header) == record


def test_header_leaves_out_what_is_not_set():
    assert Submit(seq=1, kind="reset", call=2).header() == {"t": "submit", "seq": 1, "kind": "reset", "call": 2}
    assert Status().header() == {"t": "status"}
    assert "door" not in Hello(job="j", pid=1).header()  # door only when true


@pytest.mark.parametrize("header, field, why", [
    ({"t": "hello", "job": "", "pid": 1}, "job", "has 0 characters, expected 1..200"),
    ({"t": "hello", "job": "j", "pid": MAX_PID + 1}, "pid", f"outside 1..{MAX_PID}"),
    ({"t": "hello", "job": "j"}, "pid", "is missing"),
    ({"t": "hello", "job": "j", "pid": 1, "door": "yes"}, "door", "expected true or false"),
    ({"t": "alloc", "slot": MAX_SLOTS, "nbytes": 1}, "slot", f"outside 0..{MAX_SLOTS - 1}"),
    ({"t": "alloc", "slot": True, "nbytes": 1}, "slot", "is bool, expected an integer"),
    ({"t": "submit", "call": 1, "seq": "3", "kind": "allreduce"}, "seq", "is str, expected an integer"),
    ({"t": "submit", "call": 1, "seq": 3, "kind": "gather"}, "kind", "expected one of allreduce, broadcast"),
    ({"t": "submit", "call": 1, "seq": 3, "kind": "allreduce"}, "name", "is missing"),
    ({"t": "submit", "call": 1, "seq": 3, "kind": "allreduce", "name": "w", "shape": [4], "dtype": "uint8",
      "slot": 0}, "dtype", "is 'uint8', expected one of float16"),
    ({"t": "submit", "call": 1, "seq": 3, "kind": "allreduce", "name": "w", "shape": [-1], "dtype": "float32",
      "slot": 0}, "shape", "is not a list of non-negative integers"),
    ({"t": "submit", "call": 1, "seq": 3, "kind": "allreduce", "name": "w", "shape": [1 << 40], "dtype": "float32",
      "slot": 0}, "shape", "more than any shared-memory segment holds"),
    ({"t": "submit", "seq": 3, "kind": "barrier"}, "call", "is missing"),
    ({"t": "warm", "codec": "", "call": 1}, "codec", "expected a codec name"),
    ({"t": "warm", "codec": "qsgd", "params": [3], "call": 1}, "params", "is list, expected a map"),
    ({"t": "bye", "call": 1.5}, "call", "is float, expected an integer"),
])
def test_a_bad_field_is_refused_by_name(header, field, why):
    with pytest.raises(InputError) as e:
        decode(header)
    assert f"{header['t']}: field {field!r}" in str(e.value)
    assert why in str(e.value)


@pytest.mark.parametrize("t", ["alloc ", "welcome", None, 3])
def test_an_unknown_request_is_a_protocol_error(t):
    with pytest.raises(ProtocolError, match="unknown request"):
        decode({"t": t, "call": 1})


def test_fields_outside_the_schema_are_ignored():
    assert decode({"t": "status", "call": 1, "extra": object()}) == Status(call=1)


def test_every_record_field_is_in_the_schema():
    """The records and the table the daemon checks describe the same fields (proto: the daemon's
    own version check, with a message naming both versions)."""
    import dataclasses
    for rec in (Hello, Alloc, Submit, Status, Warm, Bye):
        fields = {f.name for f in dataclasses.fields(rec)} - {"proto"}
        assert fields == {key for key, _check, _required in REQUESTS[rec.t]}, rec.t


def test_anonymous_name():
    assert anonymous_name(12) == ANONYMOUS_PREFIX + "12"


def test_the_client_side_imports_no_numba():
    code = ("import sys, birdnet.requests, birdnet.client; "
            "assert 'numba' not in sys.modules, 'numba imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
