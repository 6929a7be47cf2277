"""A bench's result appended as one JSON line with what it ran on (the host, the load average
before and after, the command): shared by the benches under runs/bench that time rounds in one
process (kivi_held_dense/slot_writes.py, pertoken_rewrite/rewrite.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flexgen_helm.memory.machine import machine_label


def append_record(out: Path, record: dict, load_before: float, command: str, **fields) -> None:
    """Prints record (with fields, the host, the load and the command added) and appends it to out."""
    record = {**record, **fields, "host": machine_label(),
              "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)], "command": command}
    print(json.dumps(record))
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
