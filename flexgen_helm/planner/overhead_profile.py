"""The engine's fixed costs on this machine: time a token step spends besides arithmetic and
data movement (Python, op dispatch, the schedule's bookkeeping, sampling), which the cost
model cannot derive from FLOP/s and bytes/s and which decides what small blocks cost.

Measured by running the engine's own block driver on a tiny random-weight model (hidden
size 32: its arithmetic is negligible) with 1 and with NB_PROBE GPU batches per block:

    step time = per_step + NB x layers x per_layer_batch

per phase (prefill, decode) and per model family (their layers launch different ops). A
mixture-of-experts block's call of its experts (one a layer and step: the block's rows
merged) costs a third figure per expert its rows choose (the gathered rows' slice, three
products, the activation, the copy of its outputs, its load and release): measured apart,
on a tiny MoE whose every token takes all PROBE_EXPERTS experts against one whose single
sequence takes one, so that

    step time = per_step + NB x layers x per_layer_batch + sparse blocks x experts x per_expert

An OLMoE-1B-7B decode step touches ~56 of 64 experts a layer (16 rows x 8 choices): at ~44 us
an expert (a 2-core EPYC) that is ~40 ms of its ~340 ms step, whose products are ~2 rows an expert.
A second figure, the copy thread's hand-off, is what each transfer costs when the schedule
runs transfers on its copy thread (executor/transfer_ways.py: with anything on disk, or on a GPU
whose copies do not go on streams) instead of inline. The probe's copies go on streams
whatever FLEXGEN_HELM_CUDA_COPIES says, so that its fixed costs hold no hand-offs: the cost
model adds them where the threads run (the H200's probe of 2026-11-29 ran its transfers on the
threads, so its per-layer figure held hand-offs that the model added again). Not inline:
an inline transfer on a GPU waits for the GPU's queue to drain, which no overlapped run does."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch

from flexgen_helm.executor.generation import BlockDriver, Sequence
from flexgen_helm.executor.runtime import ModelRuntime
from flexgen_helm.executor.sampling import RunStats, SamplingParams
from flexgen_helm.memory.copy_engine import COPIES_SETTING, CopyEngine
from flexgen_helm.memory.devices import Devices
from flexgen_helm.memory.placement import place_weights
from flexgen_helm.memory.usage import TierUsage
from flexgen_helm.memory.weight_homes import build_homes
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.moe import config_from_hf as moe_config_from_hf
from flexgen_helm.policy.policy import Policy, Split
from flexgen_helm.weights.dummy import DummyWeights

NB_PROBE = 4
PROMPT, NEW_TOKENS = 8, 6
FAMILIES = ("opt", "llama", "moe")
PROBE_EXPERTS = 8
EXPERT_ROUNDS = 4


def tiny_config(family: str, experts_per_token: int = PROBE_EXPERTS) -> ModelConfig:
    if family == "moe":  # Mixtral's block: the router and experts alone, no family's extras
        return moe_config_from_hf({
            "model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
            "num_local_experts": PROBE_EXPERTS, "num_experts_per_tok": experts_per_token,
            "max_position_embeddings": 64, "eos_token_id": 1, "pad_token_id": 0},
            f"overhead-probe-moe-{experts_per_token}")
    return ModelConfig(family=family, name=f"overhead-probe-{family}", vocab_size=64, hidden_size=32, num_layers=4,
                       num_heads=2, num_kv_heads=2, ffn_size=64, max_seq_len=64, eos_token_id=1, pad_token_id=0)


def _runtime(cfg: ModelConfig, devices: Devices) -> ModelRuntime:
    family = family_of(cfg)
    layers = family.layer_specs(cfg)
    placement = place_weights(layers, Split(1, 0, 0), None)
    source = DummyWeights(cfg)
    usage = TierUsage()
    homes = build_homes(layers, placement, devices, source.read, usage, pin=False)
    return ModelRuntime(cfg, family, layers, placement, homes, None, devices, usage)


def _run(rt: ModelRuntime, nb: int, workdir: Path, prompt: int = PROMPT) -> tuple[float, float]:
    """(prefill s, one decode step s) of a block of nb GPU batches of one sequence."""
    policy = Policy(gpu_batch_size=1, num_gpu_batches=nb)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    seqs = [Sequence(list(range(2, 2 + prompt)), params, None, frozenset()) for _ in range(nb)]
    stats = RunStats()
    with _copies_on_streams():
        BlockDriver(rt, policy, workdir, stats).generate(seqs)
    return stats.prefill_s, stats.decode_s / (NEW_TOKENS - 1)


@contextlib.contextmanager
def _copies_on_streams():
    """A GPU's copies on streams while the probe runs (module doc: no hand-offs in its figures)."""
    before = os.environ.get(COPIES_SETTING)
    os.environ[COPIES_SETTING] = "streams"
    try:
        yield
    finally:
        if before is None:
            del os.environ[COPIES_SETTING]
        else:
            os.environ[COPIES_SETTING] = before


def measure_fixed_costs(devices: Devices, repeats: int = 5) -> dict[str, dict[str, dict[str, float]]]:
    """family -> phase -> {"per_layer_batch": s, "per_step": s}, and for "moe" "per_expert": s."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="flexgen-overhead-") as tmp:
        for fam in FAMILIES:
            rt = _runtime(tiny_config(fam), devices)
            layers = len(rt.layers)
            best = _best_runs(rt, (1, NB_PROBE), Path(tmp), repeats)
            out[fam] = {}
            for i, phase in enumerate(("prefill", "decode")):
                one, many = best[1][i], best[NB_PROBE][i]
                per_layer_batch = max(0.0, (many - one) / ((NB_PROBE - 1) * layers))
                out[fam][phase] = {"per_layer_batch": per_layer_batch,
                                   "per_step": max(0.0, one - layers * per_layer_batch)}
            if fam == "moe":
                _add_per_expert(out[fam], rt, devices, Path(tmp), repeats)
    return out


def _add_per_expert(costs: dict[str, dict[str, float]], rt: ModelRuntime, devices: Devices, workdir: Path,
                    repeats: int) -> None:
    """The MoE probe: a single one-token sequence whose token takes all PROBE_EXPERTS experts
    against one whose token takes one (one token: the rows each expert multiplies are the same),
    over the blocks that have experts (the cost model charges per_expert on those alone); what
    the experts cost comes out of per_step, which held it.

    The difference is a millisecond of a step of one to two, so the two runs alternate, round
    by round, EXPERT_ROUNDS times as often as the other probes: a slow spell of a shared host
    then lands on both, and the least of each keeps the difference (a CI run once read 0.0
    from two rounds taken one after the other)."""
    few = _runtime(tiny_config("moe", 1), devices)
    for probe in (rt, few):
        _run(probe, 1, workdir, 1)  # the first calls of every op
    rounds = [(_run(rt, 1, workdir, 1), _run(few, 1, workdir, 1)) for _ in range(repeats * EXPERT_ROUNDS)]
    every = [min(r[0][i] for r in rounds) for i in range(2)]
    one = [min(r[1][i] for r in rounds) for i in range(2)]
    sparse = sum(layer.kind == "block" and rt.config.sparse_block(layer.index) for layer in rt.layers)
    for i, phase in enumerate(("prefill", "decode")):
        per_expert = max(0.0, (every[i] - one[i]) / ((PROBE_EXPERTS - 1) * sparse))
        costs[phase]["per_expert"] = per_expert
        costs[phase]["per_step"] = max(0.0, costs[phase]["per_step"] - sparse * PROBE_EXPERTS * per_expert)


def _best_runs(rt: ModelRuntime, nbs: tuple[int, ...], workdir: Path, repeats: int, prompt: int = PROMPT
               ) -> dict[int, list[float]]:
    """nb -> the least (prefill s, decode step s) of `repeats` runs, after a warm-up (the first
    calls of every op)."""
    _run(rt, max(nbs), workdir, prompt)
    return {nb: [min(x) for x in zip(*(_run(rt, nb, workdir, prompt) for _ in range(repeats)))] for nb in nbs}


def measure_handoff_s(device: torch.device, reps: int = 200) -> float:
    """One transfer submitted to the copy thread and waited for (nothing to copy): the least
    a transfer costs when the schedule runs transfers on that thread."""
    io = CopyEngine(True, device)
    try:
        io.submit(lambda: None).result()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            io.submit(lambda: None).result()
            times.append(time.perf_counter() - t0)
    finally:
        io.close()
    times.sort()
    return times[len(times) // 2]  # the median: hand-offs pay the thread wake-up every time
