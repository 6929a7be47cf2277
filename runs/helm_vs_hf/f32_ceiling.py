"""The most any exact float32 engine could gain over HELM's float32 client on one comparison's
scenarios, on this host (issue 47's 8x goal, float32 arm).

For each scenario of a `helm_clients` comparison folder that has an `hf-float32` and an
`ours-float32` row (rows.jsonl), the floor of our engine's work is the matmuls of what it
cannot skip: every prompt token it computed (the shared prefix once, each suffix) through
the layers' linears, and every generated token through the layers and the head. Attention
and everything else is left out, so this is a lower bound. It is priced at the best float32
matmul rate this host gives now, at SmolLM2's linear shapes over 4096 rows (5 rounds of 10
products of each shape; the fastest round's rate). No nominal peak is computed: the clock a
VM reports need not be the one its cores run at.
The time a run spends outside its engine (wall - engine_time_s) is HELM's start-up, scenario,
adapters and metrics, and our model's load. Its floor is that of a run of one instance of the
scenario (`--one-instance`, a comparison folder of `--max-instances 1`), which HELM's client
pays as well: the best ratio is HF's wall over (the matmuls' floor + that), and, as a looser
bound, over the floor alone.

    python -m flexgen_helm.tools.compare.helm_clients --systems ours-float32 \
        --scenarios synthetic_reasoning_natural-easy dyck_language --max-instances 1 --out <one>
    python runs/helm_vs_hf/f32_ceiling.py runs/helm_vs_hf/<comparison folder> --one-instance <one>
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from flexgen_helm.memory.machine import machine_label
from flexgen_helm.tools.compare.compute_floor import matmul_params_per_token
from flexgen_helm.tools.compare.helm_clients import MODEL
from flexgen_helm.weights.registry import resolve

ROWS = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--one-instance", type=Path, required=True)
    args = parser.parse_args()
    rows, single = read_rows(args.folder), read_rows(args.one_instance)
    runs = {scenario: paired(args, rows, single, scenario) for scenario in dict.fromkeys(r["scenario"] for r in rows)}
    cfg = resolve(MODEL).config
    per_token = matmul_params_per_token(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    rate = f32_rate_now(cfg)
    now = time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}, {now}")
    print(f"float32 matmuls at SmolLM2's linear shapes, {ROWS} rows: {rate / 1e9:.0f} GFLOP/s (the fastest round)")
    for scenario, (hf, ours, one) in runs.items():
        generated = ours["request_tokens"]
        body_rows = ours["computed_prompt_tokens"] + sum(max(0, n - 1) for n in generated)
        flop = 2.0 * (per_token - head) * body_rows + 2.0 * head * sum(generated)
        outside = one["wall_s"] - one["engine_time_s"]
        print(f"\n{scenario}: HF float32 {hf['wall_s']:.1f} s; ours float32 {ours['wall_s']:.1f} s "
              f"({hf['wall_s'] / ours['wall_s']:.2f}x), its engine {ours['engine_time_s']:.1f} s, "
              f"outside it {ours['wall_s'] - ours['engine_time_s']:.1f} s; a run of one instance "
              f"{one['wall_s']:.1f} s, outside its engine {outside:.1f} s")
        print(f"  matmuls no exact engine can skip: {ours['computed_prompt_tokens']:,} prompt tokens computed and "
              f"{sum(generated):,} generated = {flop / 1e12:.2f} TFLOP")
        floor = flop / rate
        print(f"  at that rate: {floor:.1f} s; best ratio {hf['wall_s'] / (floor + outside):.2f}x "
              f"with a one-instance run's time outside the engine, {hf['wall_s'] / floor:.2f}x with none")
        print(f"  8x needs ours within {hf['wall_s'] / 8:.1f} s in all, "
              f"{hf['wall_s'] / 8 - floor:.1f} s beside the matmuls' floor")


def paired(args, rows: list[dict], single: list[dict], scenario: str) -> tuple[dict, dict, dict]:
    """A scenario's latest HF and ours float32 rows and its one-instance row; an error naming
    what is missing, before any timing."""
    hf, ours, one = (latest(source, scenario, s) for source, s in
                     ((rows, "hf-float32"), (rows, "ours-float32"), (single, "ours-float32")))
    if hf is None or ours is None:
        missing = " and ".join(s for s, r in (("hf-float32", hf), ("ours-float32", ours)) if r is None)
        raise SystemExit(f"{args.folder} has no {missing} row of {scenario}: a bound needs both")
    if one is None:
        raise SystemExit(f"{args.one_instance} has no ours-float32 row of {scenario}")
    return hf, ours, one


def read_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines() if line.strip()]


def latest(rows: list[dict], scenario: str, system: str) -> dict | None:
    return next((r for r in reversed(rows) if r["scenario"] == scenario and r["system"] == system), None)


def f32_rate_now(cfg) -> float:
    """The fastest of 5 rounds of float32 products at the model's linear shapes over ROWS rows (the
    first, which warms the kernels up, is seldom the fastest)."""
    torch.manual_seed(0)
    shapes = [(cfg.num_heads * cfg.head_dim, cfg.hidden_size), (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size),
              (cfg.ffn_size, cfg.hidden_size), (cfg.hidden_size, cfg.ffn_size)]
    weights = [torch.randn(*s) for s in shapes]
    inputs = [torch.randn(ROWS, s[1]) for s in shapes]
    flop = sum(2.0 * ROWS * w.shape[0] * w.shape[1] for w in weights) * 10
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            for w, x in zip(weights, inputs):
                torch.nn.functional.linear(x, w)
        best = max(best, flop / (time.perf_counter() - t0))
    return best


if __name__ == "__main__":
    main()
