"""Where a compressed main-job deployment's time differs from BF16's, timed (no profiler): the
seconds in the block schedule's prefill and decode, in the cache slots' writes and, inside
them, in the caches' rounding (KIVI's completed groups, the per-token grid), and how many rows
each compressed weight's product multiplies, and on which path (its kernel or the held copy).

    python runs/compression_8bit/decode_paths/gap_parts.py [--rounds 2] [--out FILE]

The main job's saved requests through our client, bfloat16, SmolLM2 in RAM: LAMBADA's 10
(runs/bench/merged_head/lambada_requests.json) and pattern_match's first 10
(scenario_paths.py's STATE); each (workload, deployment) in its own process, the deployments
rotated round by round. Appends one JSON line per run to --out (default gap_parts.jsonl
beside this file), with the host and the load average.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scenario_paths import PATHS, REPO, STATE, TIMED_CHILD_HEAD, run_child  # noqa: E402

CHILD = TIMED_CHILD_HEAD + r"""
from flexgen_helm.compression import int4
from flexgen_helm.executor import kv_cache
name, policy = sys.argv[4], json.loads(sys.argv[5])

def timed(owner, attr, key):
    fn = getattr(owner, attr)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t0
            spent[key + "_calls"] += 1
    setattr(owner, attr, wrapper)

timed(kv_cache.KVCacheSlot, "write", "cache_writes")
timed(kv_cache.KVCacheSlot, "_round_completed_groups", "kivi_rounding")
timed(kv_cache, "fake_quantize", "per_token_rounding")
products = collections.Counter()  # (rows, path) of each compressed weight's product
linear = int4.CompressedWeight.linear
def counted(self, x, bias=None):
    rows = x.numel() // self.shape[1]
    held = self._packed is not None or self._dense is not None
    kernel = self.kernel_beats_held_copy(rows) if held else self.uses_kernel(rows)
    products[f"{rows} rows, {'kernel' if kernel else 'held copy' if held else 'dense copy'}"] += 1
    return linear(self, x, bias)
int4.CompressedWeight.linear = counted

client = FlexGenClient(BlackHoleCacheConfig(), model="smollm2-135m", deployment=f"flexgen/smollm2-135m-{name}",
                       dtype="bfloat16", **({"policy": policy} if policy else {}))
_ = client.handle, client.handle.tokenizer  # loaded before the clock starts
client.prefetch(requests)
print(json.dumps({**{k: round(v, 4) for k, v in spent.items()}, "compressed_products": dict(products)}))
"""

WORKLOADS = {"lambada-10": REPO / "runs/bench/merged_head/lambada_requests.json", "pattern_match-10": STATE}
DEPLOYMENTS = ("fp32", "4-bit-deployment", "8-bit-deployment")  # fp32: the plain one, in bf16 here


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "gap_parts.jsonl")
    args = p.parse_args()
    command = f"python runs/compression_8bit/decode_paths/gap_parts.py --rounds {args.rounds}"
    for r in range(args.rounds):
        for workload, state in WORKLOADS.items():
            order = DEPLOYMENTS[r % len(DEPLOYMENTS):] + DEPLOYMENTS[:r % len(DEPLOYMENTS)]
            for name in order:
                run_child(CHILD, name, [json.dumps(PATHS[name])], 10, command, args.out, state=state,
                          round=r, workload=workload, deployment={"fp32": "BF16"}.get(name, name),
                          code=str(REPO))


if __name__ == "__main__":
    main()
