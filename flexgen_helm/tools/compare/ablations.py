"""The paper's ablation (Table 4) on our engine: each optimization turned off in turn,
every setting a `flexgen-helm bench --label ...` run under the same budgets."""

from __future__ import annotations

from dataclasses import replace

from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.planner.budget import planned_bytes
from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.tools.compare.ours import deepspeed_policy, fits_budgets, most_weights_in_ram, searched_policy
from flexgen_helm.tools.compare.workloads import Setup
from flexgen_helm.weights.registry import resolve


def ablation_policies(setup: Setup, max_block: int) -> list[tuple[str, Policy | None, str]]:
    """(label, policy or None when it cannot run, note)."""
    best, how = searched_policy(setup, max_block), "searched (--policy auto's search)"
    out = [("all optimizations", best, how)]
    # No search: what one would type without it, one sequence with its cache on the device.
    fixed = most_weights_in_ram(setup, Policy(cache=Split(1, 0, 0), activations=Split(1, 0, 0)), use_gpu=True)
    out.append(("no policy search (fixed: 1 sequence, cache on device)", fixed, "fixed default"))
    out.append(("no overlap", replace(best, overlap=False), how))
    if best.cpu_cache_compute:
        out.append(("no CPU compute", replace(best, cpu_cache_compute=False), how))
    else:
        out.append(("no CPU compute", None, "same run as all optimizations: the searched policy does not "
                                            "delegate attention to the CPU (cpu_cache_compute off)"))
    out.append(_no_disk(setup, best))
    out.append(("DeepSpeed-style policy", deepspeed_policy(setup), "row by row, largest batch that fits"))
    return out


def _no_disk(setup: Setup, best: Policy) -> tuple[str, Policy | None, str]:
    """All weights in RAM (device pool + cpu tier) with the best policy's batching."""
    for gpu in range(100, -1, -1):
        p = replace(best, weights=Split.from_percent(gpu, 100 - gpu))
        if fits_budgets(setup, p):
            return "no disk (weights in RAM only)", p, "fits"
    cfg = resolve(setup.model, dummy=True).config
    need = planned_bytes(cfg, replace(best, weights=Split(0, 1, 0)), setup.prompt_len + setup.gen_len,
                         DTYPES[setup.dtype])
    return ("no disk (weights in RAM only)", None,
            f"does not fit: the weights alone need {need['cpu'] / 2**30:.2f} GiB of RAM, the budget is "
            f"{setup.gpu_mem} device + {setup.cpu_mem} cpu")
