"""The paper's ablation (Table 4) on our engine, derived from the searched policy of the same
compare run: each optimization turned off in turn, every setting a `flexgen-helm bench`
under the same budgets. "All optimizations" is the run's ours-auto row itself."""

from __future__ import annotations

from dataclasses import replace

from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.tools.compare.ours import BudgetCheck, most_weights_in_ram
from flexgen_helm.tools.compare.workloads import Setup


def ablation_policies(setup: Setup, best: Policy, profile: HardwareProfile) -> list[tuple[str, Policy | None, str]]:
    """(label, policy or None when it would be the same run as all optimizations or does not
    fit the budgets, note: why)."""
    out = [("no overlap", replace(best, overlap=False), "the searched policy, I/O and compute taking turns")]
    if best.cpu_cache_compute:
        out.append(("no CPU compute", replace(best, cpu_cache_compute=False), "the searched policy, attention "
                                                                             "on the compute device"))
    else:
        out.append(("no CPU compute", None, "same as all optimizations: the searched policy does not delegate "
                                            "attention to the CPU"))
    if best.num_gpu_batches > 1:
        out.append(("row-by-row schedule", replace(best, num_gpu_batches=1),
                    "the searched policy with one GPU batch per block: each weight read serves one GPU batch"))
    else:
        out.append(("row-by-row schedule", None, "same as all optimizations: the searched block is one GPU batch"))
    # no search: what one would type without it, one sequence with its cache on the device
    one_on_device = Policy(cache=Split(1, 0, 0), activations=Split(1, 0, 0))
    fixed = most_weights_in_ram(BudgetCheck(setup, profile), one_on_device, use_gpu=True)
    out.append(("no policy search", fixed, "fixed: 1 sequence, cache on the device, weights in RAM as budgets allow"
                if fixed is not None else "does not fit: one sequence's cache and activations on the device, beside "
                "the loaded weights and working set of its compute, exceed the budgets "
                f"({setup.gpu_mem} device, {setup.cpu_mem} cpu) with every weight on disk"))
    return out
