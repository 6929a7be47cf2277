"""What O_DIRECT disk reads beside it cost torch's CPU int4 kernel: a decode layer's 192
products (tiles.decode_layer: 64 experts x 3, Poisson rows of mean 4) timed alone, then with a thread
reading a 2 GiB file in 16 MiB O_DIRECT pieces (as the engine's cache lane reads a disk tier),
three rounds. The file is written once, under /tmp.

    python runs/bench/int4_rows/beside_reads.py
"""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from pathlib import Path

import torch

from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import median_seconds
from tiles import GROUP, decode_layer

FILE, FILE_BYTES, PIECE = Path("/tmp/flexgen-helm-beside-reads.bin"), 2 << 30, 16 << 20


def read_until(stop: threading.Event, total: list[int]) -> None:
    fd = os.open(FILE, os.O_RDONLY | os.O_DIRECT)
    buf, offset = mmap.mmap(-1, PIECE), 0  # page-aligned, as O_DIRECT needs
    try:
        while not stop.is_set():
            n = os.preadv(fd, [buf], offset)
            total[0] += n
            offset = (offset + n) % FILE_BYTES
    finally:
        os.close(fd)


def main() -> None:
    torch.manual_seed(0)
    if not FILE.exists() or FILE.stat().st_size < FILE_BYTES:
        with open(FILE, "wb") as f:
            for _ in range(FILE_BYTES // (64 << 20)):
                f.write(os.urandom(64 << 20))
    weights, xs = decode_layer()
    rows = sum(len(x) for x in xs)

    def layer() -> None:
        for (p, s), x in zip(weights, xs):
            torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, GROUP, s)

    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {len(weights)} products, {rows} rows; medians of 10 layers")
    for round_ in range(3):
        alone = median_seconds(layer, 10)
        stop, total = threading.Event(), [0]
        reader = threading.Thread(target=read_until, args=(stop, total))
        reader.start()
        start = time.perf_counter()
        beside = median_seconds(layer, 10)
        elapsed = time.perf_counter() - start
        stop.set()
        reader.join()
        print(f"round {round_}: alone {alone * 1e3:.1f} ms ({alone * 1e6 / rows:.1f} us a row), beside the reads "
              f"{beside * 1e3:.1f} ms ({beside * 1e6 / rows:.1f} us a row, {beside / alone:.2f}x), "
              f"reads {total[0] / elapsed / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
