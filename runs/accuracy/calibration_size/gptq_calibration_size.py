"""GPTQ (4-bit, g64 along the input dimension) with another amount of self-sampled
calibration text than the default (executor/calibration_text.CalibrationText: 16 x 128),
scored on issue 22's quick slice exactly as the accuracy sweep's w4g-g64-d1 row is.

    python runs/accuracy/calibration_size/gptq_calibration_size.py SEQUENCES LENGTH {lambada,wikitext}

An experiment, not a tool: no command takes the calibration size, so this swaps the
engine's LayerwiseGPTQ for one with the given CalibrationText, and keeps its stores in a
cache folder of its own (/tmp/gptq-calib/cache-SxL), apart from the user's. Writes
/tmp/gptq-calib/SxL__TASK.json."""

import argparse
import functools
import os
import sys

import flexgen_helm.engine as engine
from flexgen_helm.cli import main
from flexgen_helm.executor.calibration_text import CalibrationText


def run(sequences: int, length: int, task: str) -> int:
    os.environ["FLEXGEN_HELM_CACHE"] = f"/tmp/gptq-calib/cache-{sequences}x{length}"  # read at each load
    engine.LayerwiseGPTQ = functools.partial(engine.LayerwiseGPTQ,
                                             text=CalibrationText(sequences=sequences, length=length))
    limit = "500" if task == "lambada" else "8192"
    batch = ["--gpu-batch-size", "32"] if task == "lambada" else ["--gpu-batch-size", "8", "--window", "1024"]
    return main(["eval", "--task", task, "--model", "smollm2-135m", "--dtype", "float32", "--num-gpu-batches", "1",
                 *batch, "--compress-weight", "--compress-bits", "4", "--compress-group-size", "64",
                 "--quant-method", "gptq", "--compress-group-dim", "1", "--limit", limit, "--quiet",
                 "--json", f"/tmp/gptq-calib/{sequences}x{length}__{task}.json"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sequences", type=int)
    parser.add_argument("length", type=int, help="tokens per sequence, the start token included")
    parser.add_argument("task", choices=["lambada", "wikitext"])
    args = parser.parse_args()
    sys.exit(run(args.sequences, args.length, args.task))
