"""What a helm-run pays before its first scenario, at two checkouts, rounds interleaved.

    git worktree add /tmp/before <commit>
    python runs/bench/helm_run_startup/startup_ab.py --trees /tmp/before . --rounds 3 \
        --out runs/bench/helm_run_startup/startup_ab.jsonl

Each round runs, for every tree, one plain `helm-run` of 4 LAMBADA instances on
flexgen/smollm2-135m with the fake engine (tests/helm_fake_engine.py: no model to load, so the
wall time is HELM's own work plus our plugin's), in a fresh folder, cwd and PYTHONPATH the
tree. It records the wall time and the seconds until HELM logs that its run specs are made
(process start, imports, entry-point plugins: where the plugin's load is paid). Appends a JSON
line per round and tree to --out, with the host, the commit and the load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENTRY = "lambada:model=flexgen/smollm2-135m"
SHARED_DATA = Path(__file__).resolve().parents[4] / "shared" / "data"  # ../shared/data beside this checkout
RUN_SPECS_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*entries produced \d+ run specs", re.M)


def tree_env(tree: Path) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "tests")]), HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", FLEXGEN_HELM_ENGINE_FACTORY="helm_fake_engine:load",
                FLEXGEN_HELM_DATA=str(SHARED_DATA))  # the same real data for every tree


def check_imports_from(tree: Path) -> None:
    """Refuse a tree whose helm-run would load the plugin from elsewhere (an installed copy)."""
    got = subprocess.run([sys.executable, "-c", "import flexgen_helm.helm.plugin as p; print(p.__file__)"],
                         cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(got).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: helm-run would load the plugin from {got}, not from this tree")


def one_run(tree: Path) -> dict:
    helm_run = Path(sys.executable).parent / "helm-run"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(helm_run), "-r", ENTRY, "-m", "4", "--suite", "s", "-o", f"{tmp}/out", "--local-path",
               f"{tmp}/prod_env", "-n", "4", "--exit-on-error"]
        start = time.time()
        proc = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True)
        wall = time.time() - start
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"helm-run failed in {tree}:\n{log[-3000:]}")
    stamp = RUN_SPECS_LINE.search(log)
    if stamp is None:
        raise SystemExit(f"helm-run in {tree} logged no 'entries produced ... run specs' line")
    logged = datetime.datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return {"wall_s": round(wall, 2), "to_run_specs_s": round(logged - start, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    for tree in args.trees:
        check_imports_from(tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from flexgen_helm.memory.machine import machine_label

    host = machine_label()
    commits = {tree: subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                    text=True, check=True).stdout.strip() for tree in args.trees}
    one_run(args.trees[0])  # warm-up (file cache), not recorded
    for r in range(args.rounds):
        for tree in args.trees:
            row = {"round": r, "tree": str(tree), "commit": commits[tree], **one_run(tree), "host": host,
                   "loadavg_1m": os.getloadavg()[0], "utc": datetime.datetime.now(datetime.UTC).isoformat()}
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
