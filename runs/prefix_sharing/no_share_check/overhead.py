"""What prefix sharing adds to blocks whose prompts share nothing: the work itself, timed.

    python runs/prefix_sharing/no_share_check/overhead.py [--lambada 500] [--block 8]

With sharing on, a block of prompts that share nothing runs the unchanged path
(tests/test_prefix_sharing.py: test_prompts_that_share_nothing_run_as_before) after one
extra step: `shared_prefix_len`, which compares the prompts' first tokens and finds fewer
than MIN_SHARED_TOKENS in common. This times that step (thread CPU time, so that other
jobs on the machine do not inflate it) on the real LAMBADA passages and WikiText-2 windows,
cut into blocks as an evaluation cuts them, and sets it against the shortest block time of
the committed on/off runs beside this file (lambada-off-r1.json: 500 passages in blocks of
8, 16.5 s, an AVX512-BF16 host: 0.26 s a block), an upper bound on the share it can cost.
Appends one JSON line to overhead.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from flexgen_helm.data.sources import read_lambada, read_wikitext
from flexgen_helm.evaluation import lambada, wikitext
from flexgen_helm.executor.shared_prefix import shared_prefix_len
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.weights.registry import resolve

HERE = Path(__file__).resolve().parent
WINDOW = 1024


def seconds_per_block(blocks: list[list[list[int]]], reps: int = 200) -> tuple[float, int]:
    """Thread CPU seconds of shared_prefix_len per block, and how many blocks shared anything."""
    shared = sum(bool(shared_prefix_len([b], [len(p) - 1 for p in b])) for b in blocks)
    start = time.thread_time()
    for _ in range(reps):
        for b in blocks:
            shared_prefix_len([b], [len(p) - 1 for p in b])
    return (time.thread_time() - start) / (reps * len(blocks)), shared


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lambada", type=int, default=500)
    p.add_argument("--block", type=int, default=8)
    args = p.parse_args()
    tokenizer = resolve("smollm2-135m").load_tokenizer()
    items, _ = lambada.prepare(tokenizer, read_lambada()[0][:args.lambada])
    passages = sorted((it.full for it in items), key=len)
    ids, _ = wikitext.tokenize(tokenizer, read_wikitext()[0], None)
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids) - WINDOW, WINDOW)]
    committed = json.loads((HERE / "lambada-off-r1.json").read_text())
    block_s = committed["eval_s"] / -(-committed["limit"] // committed["policy"]["gpu_batch_size"])
    record = {"host": machine_label(), "block": args.block, "committed_block_s": round(block_s, 4),
              "loadavg_1m": os.getloadavg()[0]}
    for name, prompts in (("lambada", passages), ("wikitext", windows)):
        blocks = [prompts[i:i + args.block] for i in range(0, len(prompts), args.block)]
        per_block, shared = seconds_per_block(blocks)
        record[name] = {"blocks": len(blocks), "blocks_sharing": shared, "us_per_block": round(per_block * 1e6, 2),
                        "share_of_block": per_block / block_s}
        print(f"{name}: {len(blocks)} blocks, {shared} share a prefix, {per_block * 1e6:.1f} us a block "
              f"= {per_block / block_s:.2e} of a {block_s:.3f} s block")
    record["command"] = f"python runs/prefix_sharing/no_share_check/overhead.py --lambada {args.lambada} " \
                        f"--block {args.block}"
    with open(HERE / "overhead.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
