"""python run.py NAME DAMP SHRINK_MIN SHRINK_STEPS TASK [seq len]"""
import os, sys, json
import flexgen_helm.compression.gptq as g
import flexgen_helm.executor.layerwise_gptq as lg
import flexgen_helm.engine as engine, functools
from flexgen_helm.executor.calibration_text import CalibrationText
from flexgen_helm.cli import main
name, damp, smin, steps, task = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
g.DAMP = damp; lg.DAMP = damp
g.CLIP_SHRINKS = tuple(1.0 - (1.0 - smin) * i / max(steps - 1, 1) for i in range(steps)) if steps > 1 else (1.0,)
if len(sys.argv) > 6:
    engine.LayerwiseGPTQ = functools.partial(engine.LayerwiseGPTQ, text=CalibrationText(sequences=int(sys.argv[6]), length=int(sys.argv[7])))
os.environ["FLEXGEN_HELM_CACHE"] = f"/tmp/exp22/cache-{name}"
limit = "500" if task == "lambada" else "8192"
batch = ["--gpu-batch-size", "32"] if task == "lambada" else ["--gpu-batch-size", "8", "--window", "1024"]
sys.exit(main(["eval", "--task", task, "--model", "smollm2-135m", "--dtype", "float32", "--num-gpu-batches", "1",
                 *batch, "--compress-weight", "--compress-bits", "4", "--compress-group-size", "64",
                 "--quant-method", "gptq", "--compress-group-dim", "1", "--limit", limit, "--quiet",
                 "--json", f"/tmp/exp22/{name}__{task}.json"]))
