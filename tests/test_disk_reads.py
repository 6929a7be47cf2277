"""The disk tier's reader (memory/direct_io.py): several aligned O_DIRECT reads in flight
must return exactly the bytes asked for, at any offset and length, and say so when the
file is shorter than the read."""

from __future__ import annotations

import os

import pytest

from flexgen_helm.memory.direct_io import ALIGN, MIN_PIECE, read_bytes


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("direct") / "data.bin"
    data = os.urandom(5 * MIN_PIECE + 1234)  # not a whole number of pages: the last read is short
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("offset,length", [
    (0, 10), (1, ALIGN), (ALIGN - 1, 3 * ALIGN + 5),  # small, unaligned: one read
    (0, 4 * MIN_PIECE), (777, 4 * MIN_PIECE + 3),  # split into reads in flight
    (MIN_PIECE // 2, None),  # to the last byte of the file, which ends inside a page
])
@pytest.mark.parametrize("in_flight", [1, 4])
def test_reads_return_exactly_the_bytes_asked_for(data_file, offset, length, in_flight):
    path, data = data_file
    length = len(data) - offset if length is None else length
    got = read_bytes(path, offset, length, in_flight=in_flight)
    assert bytes(got) == data[offset:offset + length]


@pytest.mark.parametrize("in_flight", [1, 4])
def test_a_read_past_the_end_says_it_was_short(data_file, in_flight):
    path, data = data_file
    with pytest.raises(EOFError, match="short read"):
        read_bytes(path, len(data) - 100, 2 * MIN_PIECE, in_flight=in_flight)
