"""The FlexGen reference (PyPI `flexgen` 0.1.8, the paper's own implementation) as a row of
a comparison. Run as its own process so its memory is its own:

    python -m flexgen_helm.tools.compare.flexgen_reference --setup NAME --json OUT [--four-bit]

It runs `python -m flexgen.flex_opt` on dummy weights with the policy FlexGen's benchmark
suite publishes for the paper's setting (benchmark/flexgen/bench_suite.py in FlexGen's
repository: OPT-6.7B, prompt 512 / gen 32 on a 16 GB T4), and reads the timings its log
writes. FlexGen's flex_opt needs a CUDA GPU (it builds its devices on cuda:0 whatever the
policy) and times its own prefill and decode as we do (throughput = generated tokens over
prefill plus decode).

flex_opt makes its prompt with OPT-30B's tokenizer from the Hugging Face hub. With dummy
weights only the ids' range matters, so on a machine without the hub this module saves our
byte stand-in tokenizer under that name in a hub cache of its own and points the run there
(HF_HUB_CACHE, offline): the prompt's ids change, the work done does not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

from flexgen_helm.memory.machine import machine_info
from flexgen_helm.models.tokenizer import byte_standin_tokenizer
from flexgen_helm.tools.compare.workloads import SETUPS, Setup, work_dir
from flexgen_helm.weights.registry import resolve

# FlexGen's published policies (its benchmark suite) by setup: uncompressed, and with its
# 4-bit weights and cache
PUBLISHED = {
    "opt-6.7b-p512-g32-gpu16": {
        "plain": "--percent 100 0 100 0 100 0 --gpu-batch-size 2 --overlap False",
        "4bit": "--percent 100 0 100 0 100 0 --gpu-batch-size 72 --overlap False --compress-weight --compress-cache",
    },
}
TOKENIZER_NAME = "facebook/opt-30b"  # what flex_opt asks the hub for (OPT models other than galactica)
_SNAPSHOT = "0" * 40
_LOG_FIELDS = {"prefill_latency_s": "prefill latency", "prefill_throughput": "prefill throughput",
               "decode_latency_s": "decode latency", "decode_throughput": "decode throughput",
               "total_latency_s": "total latency", "total_throughput": "total throughput",
               "peak_gpu_mem_gb": "peak gpu mem"}


def offline_tokenizer_cache(setup: Setup) -> Path:
    """A hub cache holding the byte stand-in tokenizer as TOKENIZER_NAME (written once)."""
    hub = work_dir() / "flexgen-reference-hub"
    repo = hub / f"models--{TOKENIZER_NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / _SNAPSHOT
    if not (snapshot / "config.json").exists():  # written last: its presence marks completion
        byte_standin_tokenizer(resolve(setup.model, dummy=True).config).save_pretrained(snapshot)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)
        # AutoTokenizer reads the model type before the tokenizer's own files
        (snapshot / "config.json").write_text(json.dumps({"model_type": "opt"}))
    return hub


def parse_log(text: str) -> dict:
    """The numbers of flex_opt's benchmark log ("prefill latency: 1.234 s\\t...")."""
    found = {}
    for key, label in _LOG_FIELDS.items():
        m = re.search(rf"{label}: ([0-9.]+)", text)
        if m is None:
            raise ValueError(f"the FlexGen reference's log has no {label!r}:\n{text[-2000:]}")
        found[key] = float(m.group(1))
    return found


def policy_flags(setup: Setup, four_bit: bool) -> list[str]:
    if setup.name not in PUBLISHED:
        raise ValueError(f"{setup.name}: FlexGen's benchmark suite publishes no policy for it "
                         f"(known: {', '.join(PUBLISHED)})")
    return PUBLISHED[setup.name]["4bit" if four_bit else "plain"].split()


def run(setup: Setup, four_bit: bool, log_path: Path) -> dict:
    flags = policy_flags(setup, four_bit)
    if importlib.util.find_spec("flexgen") is None:
        raise RuntimeError("the FlexGen reference row needs FlexGen's package: pip install flexgen==0.1.8")
    offload = work_dir() / "flexgen-reference-offload"
    offload.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "flexgen.flex_opt", "--model", setup.model, "--path", "_DUMMY_",
           "--offload-dir", str(offload), "--prompt-len", str(setup.prompt_len), "--gen-len", str(setup.gen_len),
           *flags, "--log-file", str(log_path)]
    env = {**os.environ, "HF_HUB_CACHE": str(offline_tokenizer_cache(setup)), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the FlexGen reference failed (exit {done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stderr[-3000:]}")
    timings = parse_log(log_path.read_text())
    gbs = int(flags[flags.index("--gpu-batch-size") + 1])
    nb = int(flags[flags.index("--num-gpu-batches") + 1]) if "--num-gpu-batches" in flags else 1
    return {
        "system": "flexgen-reference-4bit" if four_bit else "flexgen-reference",
        "label": "FlexGen reference (PyPI flexgen 0.1.8), its published policy" + (", 4-bit" if four_bit else ""),
        "setup": setup.to_dict(), "model": setup.model, "dtype": "float16", "prompt_len": setup.prompt_len,
        "gen_len": setup.gen_len, "effective_batch_size": gbs * nb, "policy_summary": " ".join(flags),
        **timings, "cpu_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "flex_opt_command": " ".join(cmd[1:]), "stdout_tail": done.stdout[-2000:],
        "hardware": machine_info(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.compare.flexgen_reference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", required=True, choices=sorted(PUBLISHED))
    p.add_argument("--four-bit", action="store_true", help="FlexGen's published policy with 4-bit weights and cache")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    r = run(SETUPS[args.setup], args.four_bit, out.with_suffix(".flexgen.log"))
    r["command"] = ("python -m flexgen_helm.tools.compare.flexgen_reference "
                    + " ".join(sys.argv[1:] if argv is None else argv))
    out.write_text(json.dumps(r, indent=1))
    print(f"FlexGen reference: batch {r['effective_batch_size']}, total {r['total_latency_s']:.2f} s, "
          f"{r['total_throughput']:.3f} token/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
