"""A preallocated file in the offload directory that holds runtime tensors (KV cache,
activations) on the disk tier."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flexgen_helm.errors import OffloadDirError
from flexgen_helm.memory.direct_io import read_bytes, write_bytes
from flexgen_helm.memory.disk_space import FULL_ERRNOS, disk_full

OFFLOAD_ADVICE = "free space, choose another --offload-dir, or keep less on disk (the policy's disk percents)"


class DiskBuffer:
    def __init__(self, path: Path, nbytes: int):
        self.path = Path(path)
        self.nbytes = nbytes
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise OffloadDirError(f"offload directory {self.path.parent} is not writable: {e.strerror}") from e
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)  # fail now, not mid-run, when the disk is full
        except OSError as e:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
            if e.errno in FULL_ERRNOS:
                raise disk_full(self.path, nbytes, "an offload file", OFFLOAD_ADVICE) from e
            raise OffloadDirError(f"offload directory {self.path.parent}: cannot allocate {self.path.name}: {e}") from e

    def write(self, offset: int, t: torch.Tensor) -> None:
        data = t.detach().to("cpu").contiguous()
        write_bytes(self.fd, offset, data.view(torch.uint8).numpy(), evict=False)

    def read(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, room_rows: int = 0) -> torch.Tensor:
        """The tensor of `shape` stored at `offset`, with `room_rows` more rows after it in
        the same buffer (shape[0] + room_rows rows; theirs undefined) for the caller to fill."""
        row = torch.empty((), dtype=dtype).element_size()
        for s in shape[1:]:
            row *= s
        nbytes = shape[0] * row
        if nbytes + room_rows * row == 0:
            return torch.empty((shape[0] + room_rows, *shape[1:]), dtype=dtype)
        data = read_bytes(self.path, offset, nbytes, bypass_page_cache=True, room=room_rows * row)
        return torch.frombuffer(data, dtype=dtype).view(shape[0] + room_rows, *shape[1:])

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)
