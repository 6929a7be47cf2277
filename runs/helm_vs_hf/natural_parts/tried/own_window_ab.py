"""A/B of a few-shot prefill window's own part (own_window_fused.patch's
attention.FUSED_OWN_WINDOW) on a HELM scenario's requests, the setting off and on in
alternating rounds (../prefix_path_ab.py's alternate_rounds: our client in bfloat16, the saved
profile applied, a fresh client each round, prefill, decode and the windows' attention timed).

    git apply runs/helm_vs_hf/natural_parts/tried/own_window_fused.patch  # the setting it flips
    python runs/helm_vs_hf/natural_parts/tried/own_window_ab.py STATE.json [--rounds 3] [--out FILE]

Appends one JSON line to --out (own_window_ab.jsonl beside this file). Its two records were
written by an earlier form of this script, with the ratios named "... off over on" and the
rounds "off" / "on"; this one names them "fused over ours".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prefix_path_ab import alternate_rounds, append


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("own_window_ab.jsonl"))
    args = p.parse_args()
    from flexgen_helm.executor import attention

    record = alternate_rounds(args.state, args.rounds, {
        "ours": lambda: attention.set_fused_own_window("cpu", False),
        "fused": lambda: attention.set_fused_own_window("cpu", True)})
    append({**record, "command": f"python runs/helm_vs_hf/natural_parts/tried/own_window_ab.py "
                                 f"{args.state.name} --rounds {args.rounds}"}, args.out)


if __name__ == "__main__":
    main()
