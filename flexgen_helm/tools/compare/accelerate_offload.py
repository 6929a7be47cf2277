"""The baseline users would pick instead: Hugging Face transformers + accelerate big-model
inference with CPU and disk offload, on a HF checkpoint exported (export_hf) from the same
dummy weights. Run as its own process so memory and disk counters are its own:

    python -m flexgen_helm.tools.compare.accelerate_offload --setup NAME --batch B --json OUT

Placement is accelerate's: infer_auto_device_map with max_memory={"cpu": cpu budget} puts
whole decoder layers in RAM until the budget is spent and the rest on "disk"; the KV cache
and activations stay on the compute device (row by row, one batch), so the batch is limited
by the device budget (`fits_device`), on a CPU as our DeepSpeed-style row is. On a GPU setup
accelerate also needs its embeddings and room for one layer there (`gpu_resident_bytes`), and
what the batch leaves holds whole layers (max_memory={0: rest, "cpu": ...}); its hooks copy
the others in at every use.

Disk honesty: accelerate reads offloaded weights through memory maps, i.e. through the OS
page cache, which on this 24 GiB machine would hold the whole model after the first token.
Its files are evicted (posix_fadvise DONTNEED) before the run and, by default, before every
forward pass (every generated token), so each token reads them from the disk as our engine
does with O_DIRECT; `disk_read_bytes` (/proc/self/io) shows what actually came from disk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.memory.machine import machine_info
from flexgen_helm.memory.usage import process_disk_read_bytes, process_peak_rss_bytes
from flexgen_helm.models import family_of
from flexgen_helm.models.tokenizer import import_transformers
from flexgen_helm.planner.budget import planned_components
from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.tools.bench import throughput
from flexgen_helm.tools.compare.disk import evict_page_cache
from flexgen_helm.tools.compare.workloads import SETUPS, Setup, prepare_hf, prompts, work_dir
from flexgen_helm.weights.registry import resolve


def device_bytes(setup: Setup, batch: int) -> int:
    """One row-by-row batch's KV cache and activations on the compute device."""
    cfg = resolve(setup.model, dummy=True).config
    row = Policy(gpu_batch_size=batch, weights=Split(0, 0, 1), cache=Split(1, 0, 0), activations=Split(1, 0, 0))
    parts = planned_components(cfg, row, setup.prompt_len + setup.gen_len, DTYPES[setup.dtype])
    return parts["cache"]["gpu"] + parts["activations"]["gpu"]


def fits_device(setup: Setup, batch: int) -> bool:
    """Row-by-row systems keep one batch's KV cache and activations on the compute device:
    the same accounting (and budget) as our DeepSpeed-style policy. On a GPU accelerate also
    needs the weights it runs from there (gpu_resident_bytes) beside them."""
    resident = gpu_resident_bytes(setup) if setup.device == "cuda" else 0
    return device_bytes(setup, batch) + resident <= setup.gpu_bytes


def gpu_resident_bytes(setup: Setup) -> int:
    """What accelerate holds on the GPU however it offloads: the embeddings (its main device
    runs from them; with none on the GPU it runs the whole model on the CPU) and room for the
    largest decoder layer, which its hooks copy in to run."""
    cfg = resolve(setup.model, dummy=True).config
    elt = DTYPES[setup.dtype].itemsize
    specs = family_of(cfg).layer_specs(cfg)
    size = {spec.name: sum(t.numel for t in spec.tensors) * elt for spec in specs}
    return size["embed"] + max(size[spec.name] for spec in specs if spec.kind == "block")


def largest_batch(setup: Setup) -> int:
    """The largest batch that fits the device budget (tried from the top down)."""
    for b in range(setup.max_batch, 0, -1):
        if fits_device(setup, b):
            return b
    raise ValueError(f"{setup.name}: not one sequence fits the device budget {setup.gpu_mem}")


def load_model(setup: Setup, hf_dir: Path, offload: Path, dtype: torch.dtype, batch: int):
    transformers = import_transformers()
    from accelerate import infer_auto_device_map, init_empty_weights

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    with init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    empty.tie_weights()  # lm_head shares the embedding: the device map must keep them together
    max_memory = {"cpu": setup.cpu_bytes}
    if setup.device == "cuda":
        max_memory[0] = setup.gpu_bytes - device_bytes(setup, batch)
    device_map = infer_auto_device_map(empty, max_memory=max_memory,
                                       no_split_module_classes=empty._no_split_modules, dtype=dtype)
    if setup.device == "cuda" and 0 not in device_map.values():
        raise ValueError(f"{setup.name}: batch {batch} leaves {max_memory[0] / 2**30:.2f} GiB of the GPU's "
                         f"{setup.gpu_mem}, too little for any module there: accelerate would run it all on the CPU")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, device_map=device_map,
                                                              offload_folder=str(offload), dtype=dtype)
    model.eval()
    return model, device_map


class ForwardClock:
    """Timestamps of the end of every forward pass (one per generated token): the first
    closes the prefill. Optionally evicts the offloaded files before every pass."""

    def __init__(self, model, evict_paths: list[Path] | None, device: torch.device):
        self.ends: list[float] = []
        self.evict_s = 0.0
        self._evict_paths = evict_paths
        self._device = device
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _post(self, *a):
        if self._device.type == "cuda":  # the pass has ended when its kernels have, not when they are queued
            torch.cuda.synchronize(self._device)
        self.ends.append(time.perf_counter())

    def _pre(self, *a):
        if self._evict_paths:
            t = time.perf_counter()
            evict_page_cache(self._evict_paths)
            self.evict_s += time.perf_counter() - t  # reported; tiny next to a token's reads


def modules_on(device_map: dict) -> str:
    """'3 modules on GPU 0, 30 in RAM, 2 on disk': where accelerate put the weights."""
    where = [("on GPU 0", 0), ("in RAM", "cpu"), ("on disk", "disk")]
    counts = [f"{sum(1 for d in device_map.values() if d == key)} {label}" for label, key in where]
    return "modules: " + ", ".join(c for c in counts if not c.startswith("0 ") or "RAM" in c)


def run(setup: Setup, batch: int, evict_each_token: bool = True, hf_dtype: str | None = None) -> dict:
    dtype_name = hf_dtype or setup.dtype
    dtype = DTYPES[dtype_name]
    hf_dir = prepare_hf(setup, dtype_name)
    offload = work_dir() / "accelerate-offload" / hf_dir.name
    t0 = time.perf_counter()
    model, device_map = load_model(setup, hf_dir, offload, dtype, batch)
    load_s = time.perf_counter() - t0
    on_disk = [n for n, d in device_map.items() if d == "disk"]
    disk_weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                            if any(n == m or n.startswith(m + ".") for m in on_disk))
    device = torch.device(setup.device)
    ids = torch.tensor(prompts(setup, batch, model.config.vocab_size), device=device)
    paths = [hf_dir, offload]
    evicted = evict_page_cache(paths)
    clock = ForwardClock(model, paths if evict_each_token else None, device)
    reads0 = process_disk_read_bytes()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=setup.gen_len,
                             min_new_tokens=setup.gen_len, do_sample=False, pad_token_id=model.config.pad_token_id)
    end = time.perf_counter()
    return {
        "system": "hf-accelerate" if evict_each_token else "hf-accelerate-page-cache",
        "label": (f"HF accelerate, {'gpu+' if device.type == 'cuda' else ''}cpu+disk offload"
                  + ("" if evict_each_token else ", page cache kept during the run")),
        "setup": setup.to_dict(),
        "model": setup.model,
        "dtype": dtype_name,
        "prompt_len": setup.prompt_len,
        "gen_len": setup.gen_len,
        "effective_batch_size": batch,
        "policy_summary": f"bs={batch} (row by row), weights by layer: {modules_on(device_map)}; "
                          "cache and activations on the device",
        **throughput(clock.ends[0] - start, end - clock.ends[0], batch, setup.prompt_len, setup.gen_len),
        "device_map": device_map,
        "disk_weight_bytes": disk_weight_bytes,
        "disk_read_bytes": process_disk_read_bytes() - reads0,
        "page_cache": {"evicted_before_run_bytes": evicted, "evict_each_token": evict_each_token,
                       "evict_s": clock.evict_s, "read_path": "safetensors/numpy memory maps (page cache)"},
        "forward_passes": len(clock.ends),
        "load_s": load_s,
        "cpu_peak_rss_bytes": process_peak_rss_bytes(),
        "generated_token_ids": out[:, ids.shape[1]:].tolist(),
        "hardware": machine_info(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.compare.accelerate_offload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", required=True, choices=sorted(SETUPS))
    p.add_argument("--batch", type=int, help="default: the largest that fits the device budget")
    p.add_argument("--no-evict-each-token", dest="evict_each_token", action="store_false",
                   help="evict only before the run (later tokens may then come from the page cache)")
    p.add_argument("--hf-dtype", help="dtype of the exported checkpoint and of compute (default: the setup's)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    setup = SETUPS[args.setup]
    batch = args.batch or largest_batch(setup)
    r = run(setup, batch, args.evict_each_token, args.hf_dtype)
    r["command"] = ("python -m flexgen_helm.tools.compare.accelerate_offload "
                    + " ".join(sys.argv[1:] if argv is None else argv))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=1))
    print(f"accelerate: batch {batch}, total {r['total_latency_s']:.2f} s, {r['total_throughput']:.3f} token/s, "
          f"disk read {r['disk_read_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
