"""Conversion time and reconstruction error of each quantization method (issue 22), beside
the accuracy table of runs/accuracy:

    python -m flexgen_helm.tools.accuracy_sweep.conversion errors   # -> json/conversion_errors.json
    python -m flexgen_helm.tools.accuracy_sweep.conversion opt --method M   # -> json/conversion_opt-1.3b_M.json
    python -m flexgen_helm.tools.accuracy_sweep.conversion stored --method gptq --group-size 64

`errors`: for every weight setting of the report, RTN and the fitted method quantize every
compressed weight (>= 2-D) of SmolLM2-135M (float32, as the evaluations run) and of a
dummy OPT-125M (random N(0, 0.02) weights: no source grid, unlike the GGUF's Q4_1 blocks);
each gives the time and the relative reconstruction error sum((w - w_hat)^2) / sum(w^2).
`opt`: the engine's real conversion of OPT-1.3B into its compressed store (bfloat16,
packed for the CPU kernel, written to disk), from a float16 Hugging Face checkpoint as the
hub publishes it (dummy weights, exported once before the clock starts: drawing 1.3 billion
random numbers is no part of a user's conversion, reading the checkpoint is), with the CPU
time it used and the load average before and after (the machine's cores are shared); for
gptq the time includes sampling its calibration text and the layer-by-layer pass (their
parts are in the record).
`stored`: the record of a compressed store an evaluation already wrote (the first `flexgen-helm
eval --quant-method gptq` converts on load): its conversion time and the load around it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from flexgen_helm.compression.quantize import dequantize, quantize, should_compress
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import Compression
from flexgen_helm.tools.accuracy_sweep.plan import OUT
from flexgen_helm.weights.registry import resolve

SETTINGS = [(4, 32), (4, 64), (4, 128), (4, 192), (3, 64)]  # (bits, group along dim 1)
METHODS = ("rtn", "hqq")  # data-free: quantize() takes them weight by weight
CONVERTED = (*METHODS, "gptq")  # what `opt` converts: gptq calibrates on the model itself
MODELS = {"smollm2-135m": False, "facebook/opt-125m": True}  # name -> dummy
OPT = "facebook/opt-1.3b"  # what `opt` converts


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
    from flexgen_helm.engine import weight_calibration
    from flexgen_helm.tools.compare.workloads import dummy_checkpoint
    from flexgen_helm.weights.loading import open_weights

    cfg = Compression(4, 64, 1, method)
    checkpoint = dummy_checkpoint(OPT, "float16")  # as the hub publishes OPT-1.3B
    resolved = resolve(OPT, path=checkpoint)
    before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="conv-", dir=os.environ.get("FLEXGEN_HELM_OFFLOAD")) as tmp, \
            mock.patch.dict(os.environ, {"FLEXGEN_HELM_CACHE": tmp}):  # a first conversion: nothing reused
        t0, cpu0 = time.perf_counter(), time.process_time()
        store, _ = open_weights(resolved, torch.bfloat16, Path(tmp), needs_disk=True, progress=False,
                                compression=cfg, device=torch.device("cpu"),
                                calibration=weight_calibration(resolved, cfg, Path(tmp), progress=False))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        manifest = json.loads((store.store.root / "manifest.json").read_text())
    return {"model": f"{OPT} (dummy weights)", "checkpoint": f"{checkpoint} (float16)", "dtype": "bfloat16",
            "layout": manifest["layout"],
            "compression": manifest["compression"], "calibration": manifest.get("calibration"),
            "calibration_timings": manifest.get("calibration_timings"), "convert_s": manifest["convert_s"],
            "wall_s": wall,
            # CPU seconds of all this process's threads: what the cores' sharing does not inflate
            "cpu_s": cpu, "torch_threads": torch.get_num_threads(),
            "load_average_before": before, "load_average_after": os.getloadavg(), "cpus": os.cpu_count(),
            "host": machine_label(),
            "command": f"python -m flexgen_helm.tools.accuracy_sweep.conversion opt --method {method}"}


def stored_conversion(model: str, dtype: str, method: str, group: int) -> dict:
    """The record of a compressed store an evaluation wrote (e.g. the first `flexgen-helm eval
    --quant-method gptq`, which converts on load): its manifest's conversion time and load."""
    from flexgen_helm.compression.int4 import device_refusal
    from flexgen_helm.memory.devices import DTYPES
    from flexgen_helm.weights.compressed_store import compressed_store_dir, store_layout
    from flexgen_helm.weights.registry import store_dir_for

    cfg = Compression(4, group, 1, method)
    torch_dtype, cpu = DTYPES[dtype], torch.device("cpu")
    layout = store_layout(torch_dtype, cpu)
    root = compressed_store_dir(store_dir_for(resolve(model), dtype), cfg, layout)
    try:
        manifest = json.loads((root / "manifest.json").read_text())
    except OSError as e:
        raise SystemExit(f"no compressed store at {root} ({e}): run the evaluation that converts it first") from e
    if not manifest.get("complete") or "convert_load_average" not in manifest:
        raise SystemExit(f"{root}: incomplete, or written before conversions recorded the machine's load")
    return {"model": model, "dtype": dtype, "layout": manifest["layout"], "compression": manifest["compression"],
            "calibration": manifest.get("calibration"), "calibration_timings": manifest.get("calibration_timings"),
            "convert_s": manifest["convert_s"], "load_average_before": manifest["convert_load_average"]["before"],
            "load_average_after": manifest["convert_load_average"]["after"], "cpus": os.cpu_count(),
            "kernel_refusal": device_refusal(torch_dtype, cpu), "store": str(root),
            "command": f"python -m flexgen_helm.tools.accuracy_sweep.conversion stored --model {model} --dtype {dtype} "
                       f"--method {method} --group-size {group}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.accuracy_sweep.conversion", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["errors", "opt", "stored"])
    p.add_argument("--method", choices=CONVERTED, default="hqq", help="opt, stored: the method converted")
    p.add_argument("--model", default="smollm2-135m", help="stored: the model")
    p.add_argument("--dtype", default="float32", help="stored: the store's dtype")
    p.add_argument("--group-size", type=int, default=64, help="stored: 4-bit groups of this size along dim 1")
    args = p.parse_args(argv)
    (OUT / "json").mkdir(parents=True, exist_ok=True)
    if args.what == "errors":
        record, name = errors(), "conversion_errors.json"
    elif args.what == "opt":
        record, name = opt_conversion(args.method), f"conversion_opt-1.3b_{args.method}.json"
    else:
        record = stored_conversion(args.model, args.dtype, args.method, args.group_size)
        name = f"conversion_{args.model}_{args.method}-g{args.group_size}.json"
    (OUT / "json" / name).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record if args.what != "errors" else {"wrote": name}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
