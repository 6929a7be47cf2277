"""python run3.py NAME ASYM_DAMP ALPHA TASK [SHRINK_MIN SHRINK_STEPS]"""
import os, sys
import flexgen_helm.compression.gptq as g
import flexgen_helm.executor.layerwise_gptq as lg
from flexgen_helm.cli import main
name, adamp, alpha, task = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
lg.ASYM = alpha > 0; lg.ASYM_DAMP = adamp; lg.ASYM_ALPHA = alpha
if len(sys.argv) > 5:
    smin, steps = float(sys.argv[5]), int(sys.argv[6])
    g.CLIP_SHRINKS = tuple(1.0 - (1.0 - smin) * i / max(steps - 1, 1) for i in range(steps))
os.environ["FLEXGEN_HELM_CACHE"] = f"/tmp/exp22/cache-{name}"
limit = os.environ.get("LIMIT", "500" if task == "lambada" else "8192")
lim = ["--limit", limit] if limit != "full" else []
batch = ["--gpu-batch-size", "32"] if task == "lambada" else ["--gpu-batch-size", "8", "--window", "1024"]
sys.exit(main(["eval", "--task", task, "--model", "smollm2-135m", "--dtype", "float32", "--num-gpu-batches", "1",
                 *batch, "--compress-weight", "--compress-bits", "4", "--compress-group-size", "64",
                 "--quant-method", "gptq", "--compress-group-dim", "1", *lim, "--quiet",
                 "--json", f"/tmp/exp22/{name}__{task}.json"]))
