"""Policy search (FlexGen Section 4.3): for each block shape (GPU batch size, number of GPU
batches), the placement is a linear program in the nine fractions; solve it, round to a
placement the engine realises (whole percents), re-evaluate with the cost model, keep the
fastest.

The LP, for one block shape:

    minimise   sum_l P_l + (n - 1) * sum_l D_l            (block latency; P, D: per-layer epigraph)
    subject to P_l >= prefill term r of layer l            for every layer l and resource r
               D_l >= decode term r of layer l
               peak bytes of tier t (prefill and decode)  <= budget of t
               wg+wc+wd = cg+cc+cd = hg+hc+hd = 1, all fractions in [0, 1]
               sum_l P_l + (n - 1) * sum_l D_l <= max latency   (optional)

The coefficients come from the cost model itself, which is affine in the fractions: its
value at the origin is the constant, its value at each unit vector minus that the slope.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import numpy as np
from scipy.optimize import linprog

from flexgen_helm.compression.grids import WeightGrids
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor.kept_weights import check_keep_dense
from flexgen_helm.memory.disk_space import size_text
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.planner.budget import planned_components
from flexgen_helm.planner.cost_model import PHASES, TERMS, CostModel, Estimate, Fractions, Workload
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import TIERS, Compression, Policy, Split

NF = len(Fractions.NAMES)
GIB = 2**30
NEAR_BEST = 0.02  # predictions within 2% are a tie: the cost model is not that exact


@dataclass(frozen=True)
class Budgets:
    """Bytes allowed per tier (None: unbounded). On a CPU-only machine the gpu tier is a pool
    of host RAM: unless a gpu budget is given, it shares the cpu budget (`shared_host`); when
    both are given, the process's whole host RAM (both tiers and `process_bytes`, what the
    process holds besides its tensors: Python, torch) must fit their sum (`host_ram`), so that
    a user who sizes the budgets to the machine is not swapped."""

    gpu: int | None = None
    cpu: int | None = None
    disk: int | None = None
    shared_host: bool = False
    host_ram: bool = False
    process_bytes: int = 0

    def constraints(self) -> list[tuple[str, dict[str, float], int]]:
        """(budget, tier weights, limit) of each memory constraint."""
        out = []
        if self.gpu is not None and not self.shared_host:
            out.append(("gpu", {"gpu": 1.0}, self.gpu))
        if self.cpu is not None:
            if self.shared_host:
                out.append(("cpu", {"gpu": 1.0, "cpu": 1.0}, self.cpu - self.process_bytes))
            else:
                out.append(("cpu", {"cpu": 1.0}, self.cpu))
        if self.host_ram and not self.shared_host and self.gpu is not None and self.cpu is not None:
            out.append(("host", {"gpu": 1.0, "cpu": 1.0}, self.gpu + self.cpu - self.process_bytes))
        if self.disk is not None:
            out.append(("disk", {"disk": 1.0}, self.disk))
        return out

    def tightened(self, budget: str, nbytes: int) -> "Budgets":
        """The same budgets with constraint `budget` lowered by `nbytes`."""
        if budget == "host":  # its limit is gpu + cpu - process_bytes
            return replace(self, process_bytes=self.process_bytes + nbytes)
        return replace(self, **{budget: getattr(self, budget) - nbytes})

    def label(self, budget: str) -> str:
        gib = self.process_bytes / GIB
        if budget == "cpu" and self.shared_host:
            return (f"cpu (host RAM, which the gpu pool and the process's own {gib:.2f} GiB share on this CPU-only "
                    "machine)")
        if budget == "host":
            return f"host RAM (the gpu pool and cpu budgets together, less the process's own {gib:.2f} GiB)"
        return budget


def default_budgets(profile: HardwareProfile, gpu: int | None = None, cpu: int | None = None,
                    disk: int | None = None) -> Budgets:
    """What the user gave, else what the machine has (with headroom for the process itself)."""
    if gpu is None and profile.is_cuda:
        gpu = int(profile.gpu_mem_bytes * 0.9)
    if cpu is None:
        cpu = int((profile.cpu_available_bytes or profile.cpu_mem_bytes) * 0.8)
    if disk is None and profile.disk_free_bytes:
        disk = int(profile.disk_free_bytes * 0.9)
    return Budgets(gpu, cpu, disk, shared_host=not profile.is_cuda and gpu is None, host_ram=not profile.is_cuda,
                   process_bytes=profile.process_baseline_bytes)


@dataclass
class SearchOptions:
    compress_weight: Compression | None = None  # compression changes the numbers: the user's choice
    compress_cache: Compression | None = None
    cpu_cache_compute: bool | None = None  # None: try both
    # None: try both where weights are compressed (not for MoE, whose experts load on demand)
    keep_dense_weights: bool | None = None
    # None: try both where the cache is compressed (Policy.keep_dense_cache)
    keep_dense_cache: bool | None = None
    max_latency_s: float | None = None  # on the block latency (prefill + all decode steps)
    max_gpu_batch_size: int = 64
    max_num_gpu_batches: int = 16
    max_block_size: int | None = None  # sequences per block (latency and padding grow with it)
    overlap: bool = True
    # what the user fixed (explicit choices win): the search chooses only what is left open
    gpu_batch_size: int | None = None
    num_gpu_batches: int | None = None
    placement: tuple[Split, Split, Split] | None = None  # weights, KV cache, activations
    # compress_weight as a loaded engine resolved it for its source (a GGUF's own codes, tensor
    # by tensor, whose formats the setting alone does not say: compression/grids.WeightGrids),
    # priced as stored where its setting is compress_weight's
    weight_grids: WeightGrids | None = None


@dataclass
class Candidate:
    policy: Policy
    estimate: Estimate
    lp_latency_s: float  # the LP's optimum before rounding


@dataclass
class SearchResult:
    policy: Policy
    estimate: Estimate
    candidates: list[Candidate] = field(default_factory=list)  # best of each block shape, fastest first
    # why a shared prompt prefix is not held once (planner/auto.searched_policy); "" where it is, or there is none
    unshared_because: str = ""


# ---- the LP's coefficients from the cost model ------------------------------------------------

_ONE_TIER = {"gpu": Split(1, 0, 0), "cpu": Split(0, 1, 0), "disk": Split(0, 0, 1)}
_KINDS = ("weights", "cache", "activations")


def _affine(shape: Policy, fn) -> tuple[np.ndarray, np.ndarray]:
    """A vector function of the policy as (constant, slopes[k, fraction]) over the fractions.

    On the simplexes (wg = 1 - wc - wd, ...) an affine function is fixed by its value with
    everything on the gpu tier and its change when one kind moves wholly to the cpu or the
    disk tier; the gpu fractions get slope 0. These placements need no rounding, so the
    cost model is exact there."""
    base_policy = replace(shape, **{k: _ONE_TIER["gpu"] for k in _KINDS})
    base = np.asarray(fn(base_policy), dtype=float)
    slopes = np.zeros((base.size, NF))
    for k, kind in enumerate(_KINDS):
        for t, tier in ((1, "cpu"), (2, "disk")):
            slopes[:, 3 * k + t] = np.asarray(fn(replace(base_policy, **{kind: _ONE_TIER[tier]})), dtype=float) - base
    return base, slopes


def time_rows(model: CostModel, shape: Policy, phase: str):
    """Per (layer, term): constant and slopes of the term's seconds."""
    return _affine(shape, lambda p: [lt[t] for lt in model.phase_terms(p, phase) for t in TERMS])


def _memory_rows(model: CostModel, shape: Policy):
    """Per (phase, tier): constant and slopes of the peak bytes."""
    def fn(p):
        peaks = model.peak_bytes(p)
        return [peaks[ph][t] for ph in PHASES for t in TIERS]
    return _affine(shape, fn)


def solve_lp(model: CostModel, policy: Policy, budgets: Budgets, max_latency_s: float | None = None,
             with_slack: bool = False, pinned_weights: Split | None = None):
    """The LP for one block shape (the policy's batching and options). Returns scipy's result;
    x[:NF] are the fractions. With `with_slack`, memory limits may be exceeded at a cost:
    the slack says which tier is short by how much. `pinned_weights` fixes the weights' fractions
    (the LP then places only the KV cache and activations)."""
    layers = len(model.groups)
    n = model.work.gen_len
    consts, slopes = {}, {}
    for phase in PHASES:
        consts[phase], slopes[phase] = time_rows(model, policy, phase)
    mem_c, mem_s = _memory_rows(model, policy)
    mem_constraints = budgets.constraints()
    nslack = len(mem_constraints) if with_slack else 0
    nvar = NF + 2 * layers + nslack
    pre = slice(NF, NF + layers)
    dec = slice(NF + layers, NF + 2 * layers)

    a_ub, b_ub = [], []
    for p, phase in enumerate(PHASES):
        for row, (c, s) in enumerate(zip(consts[phase], slopes[phase])):
            layer = row // len(TERMS)
            a = np.zeros(nvar)
            a[:NF] = s
            a[NF + p * layers + layer] = -1.0  # term <= epigraph variable of this layer
            a_ub.append(a)
            b_ub.append(-c)
    for k, (_name, weights, limit) in enumerate(mem_constraints):
        for p in range(len(PHASES)):
            a = np.zeros(nvar)
            const = 0.0
            for tier, w in weights.items():
                i = p * len(TIERS) + TIERS.index(tier)
                a[:NF] += w * mem_s[i]
                const += w * mem_c[i]
            if with_slack:
                a[NF + 2 * layers + k] = -1.0
            a_ub.append(a / GIB)  # GiB keeps the LP well scaled next to seconds
            b_ub.append((limit - const) / GIB)
    objective = np.zeros(nvar)
    objective[pre] = model.counts
    objective[dec] = (n - 1) * np.asarray(model.counts, dtype=float)
    if max_latency_s is not None:  # the steps' fixed costs are constants outside the per-layer terms
        a_ub.append(objective.copy())
        b_ub.append(max_latency_s - model.step_overhead_s("prefill") - (n - 1) * model.step_overhead_s("decode"))
    if with_slack:
        objective = np.zeros(nvar)
        objective[NF + 2 * layers:] = 1.0
    a_eq = np.zeros((3, nvar))
    for k in range(3):
        a_eq[k, 3 * k:3 * k + 3] = 1.0
    bounds = [(0, 1)] * NF + [(0, None)] * (2 * layers + nslack)
    if pinned_weights is not None:
        bounds[:3] = [(f, f) for f in pinned_weights.as_tuple()]
    return linprog(objective, A_ub=np.array(a_ub), b_ub=np.array(b_ub), A_eq=a_eq, b_eq=np.ones(3),
                   bounds=bounds, method="highs")


# ---- rounding to a placement the engine realises -----------------------------------------------

def _round_split(gpu: float, cpu: float, down: bool) -> Split:
    """Whole percents. `down` moves the rounding towards the lower tiers (never more memory
    on the upper ones than the LP asked for)."""
    r = math.floor if down else round
    g = min(max(r(100 * gpu + 1e-9), 0), 100)
    gc = min(max(r(100 * (gpu + cpu) + 1e-9), g), 100)
    return Split.from_percent(g, gc - g)


def rounded_policies(policy: Policy, x, merge_host_tiers: bool = False) -> list[Policy]:
    """The LP's placement rounded to whole percents (towards the upper tiers and towards the
    lower ones). `merge_host_tiers` (a CPU-only machine, where the gpu and cpu tiers are both
    host RAM): also the weights' RAM share on one tier, and all of them on disk, since a tensor
    split over tiers is assembled into a copy at every use, which costs memory and time the
    LP cannot see (OPT-6.7B 512/32 in a 1.5 GiB pool: the LP's 20% in RAM left no room for a
    block of 32; all on disk fits it and predicts 5x the throughput of the block that did fit)."""
    fr = Fractions.from_vector(x[:NF])
    out = []
    for down in (False, True):
        w, c, h = (_round_split(a, b, down) for a, b in ((fr.wg, fr.wc), (fr.cg, fr.cc), (fr.hg, fr.hc)))
        variants = [w]
        if merge_host_tiers and w.gpu > 0 and w.cpu > 0:
            variants += [Split(w.gpu + w.cpu, 0.0, w.disk), Split(0.0, w.gpu + w.cpu, w.disk)]
        if merge_host_tiers and w.disk > 0 and w.gpu + w.cpu > 0:
            variants.append(Split(0.0, 0.0, 1.0))
        for weights in variants:
            p = replace(policy, weights=weights, cache=c, activations=h)
            if p not in out:
                out.append(p)
    return out


def fits(est: Estimate, budgets: Budgets) -> bool:
    return not shortfalls(est, budgets)


def shortfalls(est: Estimate, budgets: Budgets) -> dict[str, int]:
    out = {}
    for name, weights, limit in budgets.constraints():
        need = max(sum(w * peak[t] for t, w in weights.items()) for peak in est.peak_bytes.values())
        if need > limit:
            out[name] = need - limit
    return out


# ---- the search -------------------------------------------------------------------------------

def search(cfg: ModelConfig, profile: HardwareProfile, prompt_len: int, gen_len: int, budgets: Budgets,
           options: SearchOptions | None = None, dtype=None, shared_prefix: int = 0) -> SearchResult:
    """shared_prefix: the tokens every prompt of a block starts with (computed once a block,
    and its KV held once, compressed too: a block of long few-shot prompts fits more
    sequences)."""
    options = options or SearchOptions()
    check_keep_dense(bool(options.keep_dense_weights), cfg)
    model = CostModel(cfg, profile, Workload(prompt_len, gen_len, shared_prefix), dtype, options.weight_grids)
    delegation = (False, True) if options.cpu_cache_compute is None else (options.cpu_cache_compute,)
    keeping = ((False, True) if options.compress_weight is not None and not cfg.is_moe else (False,)
               ) if options.keep_dense_weights is None else (options.keep_dense_weights,)
    dense_cache = ((False, True) if options.compress_cache is not None else (False,)
                   ) if options.keep_dense_cache is None else (options.keep_dense_cache,)
    candidates: list[Candidate] = []
    gbs_list = ([options.gpu_batch_size] if options.gpu_batch_size is not None
                else [2**i for i in range(int(math.log2(options.max_gpu_batch_size)) + 1)])
    nb_list = ([options.num_gpu_batches] if options.num_gpu_batches is not None
               else [2**i for i in range(int(math.log2(options.max_num_gpu_batches)) + 1)])
    for gbs in gbs_list:
        for nb in nb_list:
            if options.max_block_size is not None and gbs * nb > options.max_block_size:
                continue
            best = None
            for deleg, keep, dense in itertools.product(delegation, keeping, dense_cache):
                shape = Policy(gbs, nb, overlap=options.overlap, cpu_cache_compute=deleg,
                               compress_weight=options.compress_weight, compress_cache=options.compress_cache,
                               keep_dense_cache=dense)
                found = _found(model, shape, keep, budgets, options)
                if found is not None and (best is None or found.estimate.throughput > best.estimate.throughput):
                    best = found
            if best is not None:
                candidates.append(best)
    if not candidates and options.keep_dense_cache:
        raise PolicyError("keep_dense_cache: no block fits the budgets with the compressed cache held dense (the "
                          "dense cache's size; KIVI: in memory, all on the top tier unless placed); drop "
                          "--keep-dense-cache (--no-keep-dense-cache) or raise the budgets")
    if not candidates and options.keep_dense_weights:
        where = "the given placement" if options.placement is not None else "every weight on the top tier"
        gpu = size_text(budgets.gpu) if budgets.gpu is not None else "unbounded"
        raise PolicyError(f"keep_dense_weights: no block fits the budgets (gpu tier {gpu}) with {where} and "
                          "a dense copy of every compressed weight held for the block; drop --keep-dense-weights "
                          "(--no-keep-dense-weights) or give the gpu tier more memory (--gpu-mem)")
    if not candidates:
        pinned = options.placement is not None or options.gpu_batch_size or options.num_gpu_batches
        raise PolicyError(_pinned_message(model, budgets, options) if pinned
                          else _infeasible_message(model, budgets, options))
    candidates.sort(key=lambda c: -c.estimate.throughput)
    best = _smallest_near_best(candidates)
    return SearchResult(best.policy, best.estimate, candidates)


def _found(model: CostModel, shape: Policy, keep: bool, budgets: Budgets, options: SearchOptions
           ) -> Candidate | None:
    """The best candidate of one block shape: with the user's placement, else everything on the
    top tier where it fits (the fastest, no LP needed), else the LP's. A block that keeps dense
    copies of its weights (keep) holds them in memory, as a KIVI cache held dense holds the
    cache (it rounds each group in place): these try the user's placement, else everything on
    the top tier (no LP)."""
    in_memory = shape.keep_dense_cache and shape.compress_cache.kivi  # (Policy.validate)
    if keep or in_memory:
        placement = options.placement or (_ONE_TIER["gpu"],) * 3
        if (keep and placement[0].disk > 0) or (in_memory and placement[1].disk > 0):
            return None
        return _placed(model, replace(shape, keep_dense_weights=keep),
                       placement, budgets, options.max_latency_s)
    if options.placement is not None:
        return _placed(model, shape, options.placement, budgets, options.max_latency_s)
    return (_placed(model, shape, (_ONE_TIER["gpu"],) * 3, budgets, options.max_latency_s)
            or _best_rounded(model, shape, budgets, options.max_latency_s))


def _smallest_near_best(candidates: list[Candidate]) -> Candidate:
    """The smallest block within NEAR_BEST of the fastest prediction: when prefill compute
    dominates, every large block predicts about the same throughput, and a smaller one has
    less latency, less memory and less padding (sequences of a block pad to its longest)."""
    top = candidates[0].estimate.throughput
    near = [c for c in candidates if c.estimate.throughput >= (1 - NEAR_BEST) * top]
    return min(near, key=lambda c: (c.policy.block_size, -c.estimate.throughput))


def _placed(model: CostModel, shape: Policy, placement: tuple[Split, Split, Split], budgets: Budgets,
            max_latency_s: float | None) -> Candidate | None:
    """The block shape with the user's placement: a candidate if it fits the budgets (and the
    latency bound), else None."""
    policy = replace(shape, **dict(zip(_KINDS, placement)))
    est = model.estimate(policy)
    if not fits(est, budgets) or (max_latency_s is not None and est.total_s > max_latency_s):
        return None
    return Candidate(policy, est, est.total_s)


def _best_rounded(model: CostModel, shape: Policy, budgets: Budgets, max_latency_s: float | None,
                  pinned_weights: Split | None = None, attempts: int = 4) -> Candidate | None:
    """Solve, round, re-evaluate. The LP sees continuous fractions; the engine's placement
    also assembles tensors split over tiers (a working copy the LP cannot see) and rounds to
    whole percents, so when no rounding fits, solve again with the budget that fell short
    tightened by the shortfall plus one percent of the weights (one rounding step). A rounding
    that fell short is solved again so even when another one fit: the one that fit may be a
    far slower variant (all weights on disk), where the LP's own placement, a step smaller,
    would fit (Qwen3-30B-A3B with 4-bit weights in a 1.5 GiB pool and 12 GiB of RAM: its
    5/70/25 fell 0.03 GiB short of the pool, and all on disk predicted 0.33 token/s against
    1.21 for 0/70/30). A tightening that leaves the LP no placement is made again from the
    same budgets with half the step beyond the shortfall. `pinned_weights`: the LP places only
    the KV cache and activations."""
    on_disk = replace(shape, weights=_ONE_TIER["disk"])
    step = 0.01 * planned_components(model.cfg, on_disk, model.work.max_len, model.dtype)["weights"]["disk"]
    tight, overall, tightened_from = budgets, None, None
    for _ in range(attempts):
        res = solve_lp(model, shape, tight, max_latency_s, pinned_weights=pinned_weights)
        if res.status != 0 and tightened_from is None:
            return overall
        if res.status != 0:
            # tightened past any placement: tighten the same budgets by the shortfall and half
            # the step (OPT-6.7B 512/32, 1 x 32, weights on disk, in a 1.5 GiB pool and 4 GiB of
            # RAM: its cache's 2/45/53 fell 0.1 GiB short of the pool, and with the whole step
            # more no placement fitted, where 0/45/55 does)
            step /= 2
            tight = tightened_from[0]
            for b, need in tightened_from[1].items():
                tight = tight.tightened(b, int(need + step))
            continue
        policies = rounded_policies(shape, res.x, merge_host_tiers=not model.hw.is_cuda and pinned_weights is None)
        best, least_short = None, None
        for p in policies:
            est = model.estimate(p)
            short = shortfalls(est, budgets)
            if short:
                if least_short is None or sum(short.values()) < sum(least_short.values()):
                    least_short = short
                continue
            if max_latency_s is not None and est.total_s > max_latency_s:
                continue
            if best is None or est.throughput > best.estimate.throughput:
                best = Candidate(p, est, float(res.fun))
        if pinned_weights is None:
            for moved in _moved_weights(shape, res.x, policies):
                refilled = _best_rounded(model, shape, budgets, max_latency_s, pinned_weights=moved)
                if refilled is not None and (best is None or refilled.estimate.throughput > best.estimate.throughput):
                    best = refilled
        if best is not None and (overall is None or best.estimate.throughput > overall.estimate.throughput):
            overall = best
        if least_short is None:
            return overall
        tightened_from = (tight, least_short)
        for b, need in least_short.items():
            tight = tight.tightened(b, int(need + step))
    return overall


def _moved_weights(shape: Policy, x, rounded: list[Policy]) -> list[Split]:
    """The weights' placements among `rounded` that a rounding variant moved off the tiers
    the LP gave them (rounded_policies' variants for a CPU-only machine). The RAM they leave
    can hold KV cache and activations, so the search solves again with each one pinned.
    Without that, OPT-6.7B 128/128 in a 1.5 GiB pool and 4 GiB of RAM ran all on disk and
    left the RAM empty (predicted 4.35 token/s; with 23% of the cache in RAM, 4.80)."""
    lp_weights = {p.weights for p in rounded_policies(shape, x)}
    return list(dict.fromkeys(p.weights for p in rounded if p.weights not in lp_weights))


def _pinned_message(model: CostModel, budgets: Budgets, options: SearchOptions) -> str:
    """What falls short with the block and placement the user fixed (for a placement left
    open: all on disk, the least memory there is; for a block dimension left open: 1)."""
    shape = Policy(options.gpu_batch_size or 1, options.num_gpu_batches or 1, overlap=options.overlap,
                   compress_weight=options.compress_weight, compress_cache=options.compress_cache)
    placement = options.placement or (_ONE_TIER["disk"],) * 3
    short = shortfalls(model.estimate(replace(shape, **dict(zip(_KINDS, placement)))), budgets)
    what = f"{options.gpu_batch_size or 1} x {options.num_gpu_batches or 1} GPU batches"
    if options.placement is not None:
        pct = ", ".join(f"{kind} " + "/".join(f"{100 * f:g}" for f in split.as_tuple())
                        for kind, split in zip(_KINDS, options.placement))
        what += f", {pct} (gpu/cpu/disk %)"
    if not short:
        limit = f" within the latency limit of {options.max_latency_s:g} s" if options.max_latency_s else ""
        return f"no policy with {what} (as you set them) fits the memory budgets{limit} once rounded to the engine's"
    limits = {name: limit for name, _, limit in budgets.constraints()}
    parts = [f"it needs {size_text(limits[n] + b)} on the {budgets.label(n)} tier, {size_text(limits[n])} allowed"
             for n, b in short.items()]
    return (f"{model.cfg.name} does not fit the memory budgets with {what} (as you set them): " + "; ".join(parts)
            + " (set a smaller block, move more to a lower tier, or raise that budget)")


def _infeasible_message(model: CostModel, budgets: Budgets, options: SearchOptions) -> str:
    """Which tier is short, by how much, for the smallest block (one sequence)."""
    shape = Policy(1, 1, overlap=options.overlap, compress_weight=options.compress_weight,
                   compress_cache=options.compress_cache)
    res = solve_lp(model, shape, budgets, with_slack=True)
    names = [budgets.label(name) for name, _, _ in budgets.constraints()]
    slack = res.x[NF + 2 * len(model.groups):] if res.status == 0 else []
    short = {n: s * GIB for n, s in zip(names, slack) if s > 1e-9}
    if not short and options.max_latency_s is not None:
        return (f"no policy meets the latency limit of {options.max_latency_s:g} s for one block "
                f"(prompt {model.work.prompt_len}, {model.work.gen_len} new tokens); raise --max-latency")
    if not short:  # fits continuously but not once rounded: the engine's own placement, all on disk
        lowest = replace(shape, **{k: _ONE_TIER["disk"] for k in _KINDS})
        short = {budgets.label(n): b for n, b in shortfalls(model.estimate(lowest), budgets).items()}
    parts = [f"the {n} tier is short by {b / GIB:.2f} GiB" for n, b in short.items()] or [
        "every placement that fits continuously falls short once rounded to the engine's (tensors split over "
        "tiers are assembled into a working copy)"]
    return (f"no placement of {model.cfg.name} fits the memory budgets even with one sequence per block: "
            + "; ".join(parts) + " (raise that budget, or compress weights / KV cache)")
