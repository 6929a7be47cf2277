"""Resumable evaluations: each finished chunk's per-item results are appended to a
progress file beside the run's JSON record (FILE.partial.jsonl), and a rerun of the same
command picks up where the last one stopped. A full-set evaluation takes hours on a
2-core machine, longer than a process may live; the file is deleted once the record
is written.

The file opens with the run's fingerprint (everything that decides the numbers: task,
model, dtype, policy, data, limit, window, scoring mode); a file of another fingerprint
is set aside (renamed .stale) rather than mixed in."""

from __future__ import annotations

import json
import os
from pathlib import Path


class ResumeLog:
    def __init__(self, path: str | os.PathLike | None, fingerprint: dict):
        self.path = Path(path) if path else None
        self.done: dict[str, list] = {}
        if self.path is None:
            return
        header = {"fingerprint": fingerprint}
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            if lines and _parse(lines[0]) == header:
                for line in lines[1:]:
                    entry = _parse(line)  # a line cut short by a kill is dropped, its chunk redone
                    if isinstance(entry, dict):
                        self.done.update(entry)
                return
            self.path.rename(self.path.with_name(self.path.name + ".stale"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(header) + "\n")

    def get(self, keys: list[str]) -> list[list] | None:
        """The recorded results of these items, or None if any is missing."""
        if all(k in self.done for k in keys):
            return [self.done[k] for k in keys]
        return None

    def add(self, results: dict[str, list]) -> None:
        self.done.update(results)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(results) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def finish(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _parse(line: str):
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
