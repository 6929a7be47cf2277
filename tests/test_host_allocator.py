"""The engine's host-allocator setting: applied on glibc, and off when the user says so."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from flexgen_helm.memory import host_allocator, weight_homes
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.placement import Segment
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.models.spec import LayerSpec, tensor

CHECK = "from flexgen_helm.memory.host_allocator import keep_freed_host_memory as k; print(k())"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "FLEXGEN_HELM_KEEP_FREED_MEMORY"}
    if env_value is not None:
        env["FLEXGEN_HELM_KEEP_FREED_MEMORY"] = env_value
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_applied_on_glibc():
    assert _run(None) == "True"


def test_off_when_asked():
    assert _run("0") == "False"


RELEASE = """
import torch
from flexgen_helm.memory.host_allocator import freed_resident_bytes, keep_freed_host_memory, release_freed_host_memory
from flexgen_helm.memory.usage import current_rss_bytes
keep_freed_host_memory()
big = [torch.ones(4 << 20) for _ in range(32)]  # 512 MiB, interleaved with small blocks that stay
small = [torch.ones(1024) for _ in range(32)]
del big
kept, rss = freed_resident_bytes(), current_rss_bytes()
print(kept > 400 << 20, release_freed_host_memory(1 << 30), release_freed_host_memory(64 << 20),
      freed_resident_bytes() < 64 << 20, rss - current_rss_bytes() > 400 << 20, release_freed_host_memory(64 << 20))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_freed_memory_beyond_what_is_kept_goes_back_to_the_os():
    """Freed blocks stay resident for reuse, up to the amount asked: beyond it they are
    handed back (RSS falls by them), and with nothing more to hand back nothing happens."""
    done = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False", "True", "True", "True", "False"]


HOLES = """
import sys
import torch
from flexgen_helm.memory.host_allocator import big_allocations_outside_heap, heap_free_bytes, keep_freed_host_memory
from flexgen_helm.memory.usage import resident_anonymous_bytes
keep_freed_host_memory()
def make(count):  # as dense copies are made at load: temporaries, between what stays
    made = [(torch.ones(1 << 18), torch.ones(1 << 17)) for _ in range(count)]  # 1 MiB, then 512 KiB
    return [kept for _, kept in made]  # the temporaries freed
start = heap_free_bytes()
if sys.argv[1] == "apart":
    with big_allocations_outside_heap():
        kept = make(24)
else:
    kept = make(24)
holes = heap_free_bytes() - start
after = torch.ones(1 << 20)  # after the context, a freed block stays resident for reuse again
resident = resident_anonymous_bytes()
del after
print(holes >> 20, resident - resident_anonymous_bytes() < 1 << 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_temporaries_made_outside_the_heap_leave_no_holes_between_what_stays():
    """Tensors that stay, made between temporaries: in the heap the freed temporaries leave
    holes between them (which later allocations fault in again); inside
    big_allocations_outside_heap they are mappings of their own, gone when freed, and the
    heap's setting is back once it ends."""
    def holes(mode: str) -> list[str]:
        done = subprocess.run([sys.executable, "-c", HOLES, mode], capture_output=True, text=True, check=True)
        return done.stdout.split()

    plain, apart = holes("plain"), holes("apart")
    assert int(plain[0]) >= 16 and plain[1] == "True"
    assert int(apart[0]) <= 2 and apart[1] == "True"


def test_what_a_hand_back_leaves_is_no_reason_for_the_next(monkeypatch):
    """Memory a hand-back could not return (not malloc's, or free bytes in pages in use) does
    not make every later check trim again: only what is freed beyond it counts."""
    freed, trims = [30 << 20], []
    monkeypatch.setattr(host_allocator, "freed_resident_bytes", lambda: freed[0])
    libc = SimpleNamespace(malloc_trim=lambda pad: trims.append(pad) or 1)
    monkeypatch.setattr(host_allocator, "_libc", lambda: libc)
    monkeypatch.setattr(host_allocator, "_untrimmable", 0)
    assert host_allocator.release_freed_host_memory(10 << 20)  # 30 MiB resident, all of it stays
    assert not host_allocator.release_freed_host_memory(10 << 20)
    freed[0] = 45 << 20  # 15 MiB freed beyond what stayed
    assert host_allocator.release_freed_host_memory(10 << 20)
    assert len(trims) == 2


def test_placing_weights_looks_at_freed_memory_once_per_largest_tensor_placed(monkeypatch):
    """A look at the freed memory walks malloc's free lists (ms each on a fragmented heap), so
    placement takes one before the first tensor and then once the tensors placed since add up
    to the largest: an embedding and twelve small projections smaller than it together take
    two looks, not thirteen, each keeping two copies of the largest tensor."""
    embed = LayerSpec("embed", "embed", -1, (tensor("embed", "tokens", 1000, 64),))
    blocks = [LayerSpec(f"block{i}", "block", i, tuple(tensor(f"block{i}", k, 64, 64) for k in "qkvo"))
              for i in range(3)]
    layers = [embed, *blocks]
    shapes = {t.store_name: t.shape for layer in layers for t in layer.tensors}
    placement = {name: [Segment("gpu", 0, shape[0])] for name, shape in shapes.items()}
    looks = []
    monkeypatch.setattr(weight_homes, "release_freed_host_memory", lambda keep: looks.append(keep) or False)
    homes = weight_homes.build_homes(layers, placement, Devices(torch.device("cpu"), torch.float32),
                                     lambda name: torch.zeros(shapes[name]), TierUsage(), False)
    assert len(homes) == 13
    assert looks == [2 * 1000 * 64 * 4] * 2
