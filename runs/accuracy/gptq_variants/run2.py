"""python run2.py NAME DAMP SHRINK_MIN SHRINK_STEPS TASK HEADMODE [HEADDAMP]
HEADMODE: gptq (default), rtn (tied tensor by RTN), hdamp (head's own damping)"""
import os, sys, dataclasses
import flexgen_helm.compression.gptq as g
import flexgen_helm.executor.layerwise_gptq as lg
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.cli import main
name, damp, smin, steps, task, mode = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
g.DAMP = damp; lg.DAMP = damp
g.CLIP_SHRINKS = tuple(1.0 - (1.0 - smin) * i / max(steps - 1, 1) for i in range(steps)) if steps > 1 else (1.0,)
orig_layer = lg._quantize_layer
def patched_layer(cfg, family, layer, compression, read_full, h, at, valid, dtype, compute, out):
    if layer.kind == "head" and mode == "hdamp":
        g.DAMP = float(sys.argv[7])
    try:
        return orig_layer(cfg, family, layer, compression, read_full, h, at, valid, dtype, compute, out)
    finally:
        g.DAMP = damp
        if layer.kind == "head" and mode == "rtn":
            rtn = dataclasses.replace(compression, method="rtn")
            for t in layer.tensors:
                if t.store_name in out:
                    out[t.store_name] = quantize(read_full(t.store_name).to(dtype), rtn, out[t.store_name].group_dim)
lg._quantize_layer = patched_layer
os.environ["FLEXGEN_HELM_CACHE"] = f"/tmp/exp22/cache-{name}"
limit = os.environ.get("LIMIT", "500" if task == "lambada" else "8192")
batch = ["--gpu-batch-size", "32"] if task == "lambada" else ["--gpu-batch-size", "8", "--window", "1024"]
sys.exit(main(["eval", "--task", task, "--model", "smollm2-135m", "--dtype", "float32", "--num-gpu-batches", "1",
                 *batch, "--compress-weight", "--compress-bits", "4", "--compress-group-size", "64",
                 "--quant-method", "gptq", "--compress-group-dim", "1", "--limit", limit, "--quiet",
                 "--json", f"/tmp/exp22/{name}__{task}.json"]))
