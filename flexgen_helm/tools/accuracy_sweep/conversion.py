"""Conversion time and reconstruction error of each quantization method (issue 22), beside
the accuracy table of runs/accuracy:

    python -m flexgen_helm.tools.accuracy_sweep.conversion errors   # -> json/conversion_errors.json
    python -m flexgen_helm.tools.accuracy_sweep.conversion opt      # -> json/conversion_opt-1.3b.json

`errors`: for every weight setting of the report, RTN and the fitted method quantize every
compressed weight (>= 2-D) of SmolLM2-135M (float32, as the evaluations run) and of a
dummy OPT-125M (random N(0, 0.02) weights: no source grid, unlike the GGUF's Q4_1 blocks);
each gives the time and the relative reconstruction error sum((w - w_hat)^2) / sum(w^2).
`opt`: the engine's real conversion of a dummy OPT-1.3B into its compressed store (bfloat16,
packed for the CPU kernel, written to disk), timed from the store's manifest, with the CPU
time it used and the load average before and after (the machine's cores are shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from flexgen_helm.compression.quantize import dequantize, quantize, should_compress
from flexgen_helm.policy.policy import Compression
from flexgen_helm.tools.accuracy_sweep.plan import OUT
from flexgen_helm.weights.registry import resolve

SETTINGS = [(4, 32), (4, 64), (4, 128), (3, 64)]  # (bits, group along dim 1)
METHODS = ("rtn", "hqq")
MODELS = {"smollm2-135m": False, "facebook/opt-125m": True}  # name -> dummy


def _errors_of(model: str, dummy: bool) -> list[dict]:
    source = resolve(model, dummy=dummy).source
    weights = [source.read(s.store_name).float() for s in source.tensor_specs() if should_compress(s.shape)]
    total = sum(w.double().pow(2).sum().item() for w in weights)
    out = []
    for bits, group in SETTINGS:
        for method in METHODS:
            cfg = Compression(bits, group, 1, method)
            t0, cpu0 = time.perf_counter(), time.process_time()
            quantized = [quantize(w, cfg, 1) for w in weights]
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            err = sum((dequantize(q) - w).double().pow(2).sum().item() for q, w in zip(quantized, weights))
            out.append({"model": model, "dummy": dummy, "bits": bits, "group_size": group, "method": method,
                        "quantize_s": seconds, "cpu_s": cpu, "relative_error": err / total,
                        "load_average": os.getloadavg()})
            print(out[-1], flush=True)
    return out


def errors() -> dict:
    return {"what": "reconstruction error and quantize time of every compressed weight",
            "command": "python -m flexgen_helm.tools.accuracy_sweep.conversion errors",
            "results": [r for model, dummy in MODELS.items() for r in _errors_of(model, dummy)]}


def opt_conversion(method: str) -> dict:
    from flexgen_helm.weights.loading import open_weights

    cfg = Compression(4, 64, 1, method)
    resolved = resolve("facebook/opt-1.3b", dummy=True)
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="conv-", dir=os.environ.get("FLEXGEN_HELM_OFFLOAD")) as tmp:
        t0, cpu0 = time.perf_counter(), time.process_time()
        store, _ = open_weights(resolved, torch.bfloat16, Path(tmp), needs_disk=True, progress=False,
                                compression=cfg, device=torch.device("cpu"))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        manifest = json.loads((store.store.root / "manifest.json").read_text())
    return {"model": "facebook/opt-1.3b (dummy weights)", "dtype": "bfloat16", "layout": manifest["layout"],
            "compression": manifest["compression"], "convert_s": manifest["convert_s"], "wall_s": wall,
            # CPU seconds of all this process's threads: what the cores' sharing does not inflate
            "cpu_s": cpu, "torch_threads": torch.get_num_threads(),
            "load_average_before": before, "load_average_after": os.getloadavg(), "cpus": os.cpu_count(),
            "command": f"python -m flexgen_helm.tools.accuracy_sweep.conversion opt --method {method}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.accuracy_sweep.conversion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["errors", "opt"])
    p.add_argument("--method", choices=METHODS, default="hqq", help="opt: the method converted")
    args = p.parse_args(argv)
    (OUT / "json").mkdir(parents=True, exist_ok=True)
    if args.what == "errors":
        record, name = errors(), "conversion_errors.json"
    else:
        record, name = opt_conversion(args.method), f"conversion_opt-1.3b_{args.method}.json"
    (OUT / "json" / name).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record if args.what == "opt" else {"wrote": name}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
