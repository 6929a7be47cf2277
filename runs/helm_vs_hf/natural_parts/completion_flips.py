"""How many of a HELM run's completions differ between runs of the same requests: each pair of
the given scenario_state.json files (HELM's, of one scenario), by instance, the first
completion's text. A bf16 change's effect on greedy outputs, set beside another path the
engine may take on the same host.

    python runs/helm_vs_hf/natural_parts/completion_flips.py NAME=STATE.json NAME=STATE.json [...]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path


def completions(state: Path) -> dict[str, str]:
    request_states = json.loads(state.read_text())["request_states"]
    return {rs["instance"]["id"]: rs["result"]["completions"][0]["text"] for rs in request_states}


def main() -> None:
    runs = {}
    for arg in sys.argv[1:]:
        name, _, path = arg.partition("=")
        runs[name] = completions(Path(path))
    for (a, x), (b, y) in itertools.combinations(runs.items(), 2):
        if x.keys() != y.keys():
            raise SystemExit(f"{a} and {b} hold different instances: not runs of the same requests")
        print(f"{a} vs {b}: {sum(x[k] != y[k] for k in x)} of {len(x)} completions differ")


if __name__ == "__main__":
    main()
