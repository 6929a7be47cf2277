"""The disk tier's reader (memory/direct_io.py): several aligned O_DIRECT reads in flight
must return exactly the bytes asked for, at any offset and length, and say so when the
file is shorter than the read; it reads the way this machine's profile measured faster."""

from __future__ import annotations

import os

import pytest
import torch

from flexgen_helm.executor.cache_buffers import CacheBuffers
from flexgen_helm.executor.kv_cache import KVCacheSlot
from flexgen_helm.memory import direct_io
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.direct_io import ALIGN, MIN_PIECE, read_bytes
from flexgen_helm.memory.disk_speed import fastest_direct
from flexgen_helm.memory.usage import TierUsage


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


@pytest.fixture
def reader_reset():
    yield
    direct_io.set_reads_in_flight(direct_io.READS_IN_FLIGHT)


def test_the_faster_direct_way_is_the_engines():
    assert fastest_direct({"direct_1": 1.61e9, "direct_in_flight": 1.49e9, "mmap": 2e9}) == (1, 1.61e9)
    assert fastest_direct({"direct_1": 0.7e9, "direct_in_flight": 1.0e9}) == (direct_io.READS_IN_FLIGHT, 1.0e9)
    assert fastest_direct({}) == (direct_io.READS_IN_FLIGHT, 0.0)


@pytest.mark.parametrize("one,many,want", [(1.61e9, 1.49e9, 1), (0.7e9, 1.0e9, 4)])
def test_the_saved_profile_sets_the_reader(tmp_path, reader_reset, data_file, one, many, want):
    """The way this machine's profile measured faster is the one the disk tier reads with
    (and the one the run's report names); the bytes read are the same either way."""
    from flexgen_helm.memory.machine import machine_info
    from flexgen_helm.planner.hardware_profile import HardwareProfile, use_profile

    path = tmp_path / "hardware.json"
    assert use_profile(path) is None  # no profile: the default stays
    assert direct_io.reads_in_flight() == direct_io.READS_IN_FLIGHT
    HardwareProfile(machine=machine_info(), disk_read_modes={"direct_1": one, "direct_in_flight": many}).save(path)
    assert use_profile(path).disk_reads_in_flight == want
    assert direct_io.reads_in_flight() == want
    assert ("one read at a time" in direct_io.bypass_mode()) == (want == 1)
    file, data = data_file
    assert bytes(read_bytes(file, 777, 4 * MIN_PIECE)) == data[777:777 + 4 * MIN_PIECE]


def test_a_profile_of_another_machine_leaves_the_reader_alone(tmp_path, reader_reset):
    from flexgen_helm.planner.hardware_profile import HardwareProfile, use_profile

    path = tmp_path / "hardware.json"
    HardwareProfile(machine={"cpu": "elsewhere", "cpu_cores": 1, "ram_bytes": 1},
                    disk_read_modes={"direct_1": 2e9, "direct_in_flight": 1e9}).save(path)
    assert use_profile(path) is None
    assert direct_io.reads_in_flight() == direct_io.READS_IN_FLIGHT
    with pytest.raises(ValueError):
        direct_io.set_reads_in_flight(0)


@pytest.mark.parametrize("offset,length", [(0, 10), (ALIGN - 1, 3 * ALIGN + 5), (777, 4 * MIN_PIECE + 3)])
@pytest.mark.parametrize("in_flight", [1, 4])
def test_a_read_with_room_leaves_writable_bytes_after_the_data(data_file, offset, length, in_flight):
    path, data = data_file
    got = read_bytes(path, offset, length, in_flight=in_flight, room=ALIGN + 3)
    assert len(got) == length + ALIGN + 3 and bytes(got[:length]) == data[offset:offset + length]
    got[length:] = b"\x07" * (ALIGN + 3)
    assert bytes(got[:length]) == data[offset:offset + length]


@pytest.mark.parametrize("held_out", [None, (2, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_reads_the_disk_tier_where_its_read_landed(tmp_path, held_out, dtype):
    """A dense disk tier attended on the CPU is unpacked as views of its read, in the cache's
    dtype, with the new token's column after the positions held: no buffer is taken, nothing
    copied; its values are those written (around a held-out shared prefix too)."""
    units, d, t = {"gpu": 0, "cpu": 1, "disk": 3}, 8, 9
    slot = KVCacheSlot(units, 12, d, Devices(torch.device("cpu"), dtype), TierUsage(), tmp_path / "kv", False,
                       held_out=held_out)
    k, v = torch.randn(t, 4, d).to(dtype), torch.randn(t, 4, d).to(dtype)
    slot.write(k, v, 0)
    cpu = torch.device("cpu")
    assert slot.reads_in_place("disk", cpu) and not slot.reads_in_place("cpu", cpu)
    buffers = CacheBuffers(1)
    stored = slot.read("disk", t, room=True)
    keys, values = slot.unpack("disk", stored, cpu, torch.float32, buffers)
    kept = [p for p in range(t) if held_out is None or not held_out[0] <= p < held_out[1]]
    assert keys.shape == values.shape == (3, len(kept) + 1, d) and keys.dtype == dtype
    assert keys.data_ptr() == stored[0].data_ptr() and buffers.allocations == 0
    assert torch.equal(keys[:, :-1], k[kept, 1:].transpose(0, 1))
    assert torch.equal(values[:, :-1], v[kept, 1:].transpose(0, 1))
    keys[:, -1] = 1.0  # the new token's column is the read's own room
    assert torch.equal(keys[:, :-1], k[kept, 1:].transpose(0, 1))


def test_a_ring_or_a_gpu_attention_unpacks_the_disk_tier_as_before(tmp_path):
    """A sliding window's ring wraps, and attention elsewhere than the CPU needs its own copy:
    neither reads the disk tier in place."""
    devices = Devices(torch.device("cpu"), torch.bfloat16)
    ring = KVCacheSlot({"gpu": 0, "cpu": 0, "disk": 2}, 12, 8, devices, TierUsage(), tmp_path / "ring", False,
                       window=4)
    plain = KVCacheSlot({"gpu": 0, "cpu": 0, "disk": 2}, 12, 8, devices, TierUsage(), tmp_path / "plain", False)
    assert not ring.reads_in_place("disk", torch.device("cpu"))
    assert not plain.reads_in_place("disk", torch.device("meta"))
