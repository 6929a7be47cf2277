"""Which block scores LAMBADA fastest on this machine: the first N passages scored as
`flexgen-helm eval --task lambada` scores them, once per block (GPU batch size, one GPU
batch), the blocks interleaved round by round so that a change of load hits every block
alike; each block's fastest round is kept. Writes a JSON record (times, metrics, load
averages, the command).

    python runs/default_block/block_sweep.py --limit 256 --rounds 3 --json runs/default_block/sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from flexgen_helm.data.sources import read_lambada
from flexgen_helm.engine import Engine
from flexgen_helm.evaluation import lambada
from flexgen_helm.evaluation.run import lambada_chunk
from flexgen_helm.memory.devices import DTYPE_NAMES
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy import Policy


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=["bfloat16", "float32"])
    p.add_argument("--limit", type=int, default=256, help="the first N LAMBADA passages")
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    texts, source = read_lambada(None)
    texts = texts[:args.limit]
    rows = {b: {"block": b, "seconds": [], "accuracy": None} for b in args.blocks}
    load = [os.getloadavg()[0]]
    dtype = None
    for _ in range(args.rounds):
        for b in args.blocks:
            policy = Policy(gpu_batch_size=b, num_gpu_batches=1)
            engine = Engine.load(args.model, policy, dtype=args.dtype, progress=False)
            dtype = DTYPE_NAMES[engine.runtime.devices.dtype]
            items, _ = lambada.prepare(engine.tokenizer, texts)
            t0 = time.perf_counter()
            result = lambada.evaluate(engine, items, lambada_chunk(policy), progress=False)
            rows[b]["seconds"].append(time.perf_counter() - t0)
            rows[b]["accuracy"] = result["metrics"]["accuracy"]
            rows[b]["last_word_perplexity"] = result["metrics"]["last_word_perplexity"]
            engine.close()
            load.append(os.getloadavg()[0])
    for row in rows.values():
        row["best_s"] = min(row["seconds"])
    record = {"host": machine_label(), "model": args.model, "dtype": dtype, "passages": len(texts),
              "data": source, "rounds": args.rounds, "loadavg_1m": load, "rows": list(rows.values()),
              "command": "python runs/default_block/block_sweep.py " + shlex.join(argv)}
    out.write_text(json.dumps(record, indent=1) + "\n")
    for row in rows.values():
        print(f"block {row['block']:3d}: best {row['best_s']:6.2f} s of {len(row['seconds'])} rounds, "
              f"accuracy {row['accuracy']:.4f}")
    print(f"load average (1 min) during the sweep: {min(load):.1f} to {max(load):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
