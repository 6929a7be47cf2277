"""The engine core: load a model under a policy, then generate or score token ids.

    engine = Engine.load("smollm2-135m", policy=Policy(...))
    run = engine.generate([[6403, 1980, 253, 655]], SamplingParams(max_new_tokens=8))  # "Once upon a time"
    run.results[0].completions[0].token_ids, run.stats.total_s

Token ids in, token ids (and log-probs, and the run's `RunStats`) out: text, stop strings
and the tokenizer's use live in the frontends (flexgen_helm.text, the HELM plugin,
evaluation). `EngineCore` is the contract the frontends rely on; the tests' fake engine
implements it too.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

import torch

from flexgen_helm.compression.stored import check_weight_compression
from flexgen_helm.errors import FlexGenError, PromptTooLongError
from flexgen_helm.executor.attention import check_sparse_attention
from flexgen_helm.executor.calibration_text import CalibrationText
from flexgen_helm.executor.generation import BlockDriver, LocalStage, Sequence, StageLink, StepCallback
from flexgen_helm.executor.kept_weights import check_keep_dense
from flexgen_helm.executor.kv_cache import check_cache_compression
from flexgen_helm.executor.layerwise_gptq import LayerwiseGPTQ
from flexgen_helm.executor.runtime import ModelRuntime
from flexgen_helm.executor.sampling import (
    GenerationResult,
    GenerationRun,
    RunStats,
    SamplingParams,
    ScoreResult,
    ScoreRun,
)
from flexgen_helm.memory.devices import DTYPE_NAMES, Devices, pick_devices
from flexgen_helm.memory.direct_io import bypass_mode
from flexgen_helm.memory.host_allocator import keep_freed_host_memory, release_freed_host_memory
from flexgen_helm.memory.offload_dir import usable_offload_dir
from flexgen_helm.memory.placement import place_weights
from flexgen_helm.memory.usage import TierUsage, process_peak_rss_bytes
from flexgen_helm.memory.weight_homes import build_homes
from flexgen_helm.models import family_of
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.policy.policy import CALIBRATED_METHODS, Compression, Policy
from flexgen_helm.policy.precision import setting_name
from flexgen_helm.weights.compressed_store import CompressedStore
from flexgen_helm.weights.loading import open_weights
from flexgen_helm.weights.registry import ResolvedModel, resolve
from flexgen_helm.weights.source_grids import weight_grids

logger = logging.getLogger(__name__)
_seed_counter = itertools.count()
# What placing the weights fixed (build_runtime), and what changes the numbers a loaded model
# computes (HELM's cache key, helm/engines.LoadArgs.numerics_key): a loaded engine keeps these.
FIXED_AT_LOAD = ("weights", "pin_weight", "compress_weight", "compress_cache", "attn_sparsity")


def check_fits_context(config, what: str, n_prompt: int, n_new: int) -> None:
    """A prompt of n_prompt tokens and n_new tokens to generate fit the model's context; the
    frontends call it before loading any weight (`what` names the prompt in the error)."""
    if n_prompt + n_new > config.max_seq_len:
        raise PromptTooLongError(
            f"{what} has {n_prompt} tokens; with {n_new} new tokens that is {n_prompt + n_new}, more than "
            f"the context of {config.name} ({config.max_seq_len} tokens)"
        )


class EngineCore(Protocol):
    """What the frontends (flexgen_helm.text, the HELM plugin, evaluation) need of an engine."""

    # the model's config (max_seq_len, eos_token_id, vocab_size, ...)
    config: Any
    # the model's tokenizer (a transformers tokenizer), for the frontends: the engine never uses it
    tokenizer: Any
    # the numbers it computes with, in the paper's words ("BF16", "8-bit", "4-bit"; policy/precision.py),
    # for the frontends to record beside every result
    precision: str

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 on_step: StepCallback | None = None) -> GenerationRun:
        """Completions of token-id prompts (params: one for all, or one per prompt); on_step(done,
        total) after each token step, for a progress bar (executor/generation.py)."""

    def score(self, prompts: list[list[int]], top_logprobs: int = 0, as_decode: bool = False,
              first_scored: list[int] | None = None) -> ScoreRun:
        """log p of every prompt token given the ones before it."""


class Engine:
    """The single-process engine (dist/pipeline.py: one stage of a pipeline); an EngineCore."""

    def __init__(self, resolved: ResolvedModel, runtime: ModelRuntime, policy: Policy, offload_dir: Path):
        self.resolved = resolved
        self.runtime = runtime
        self.policy = policy
        self._tokenizer = None
        self.offload_dir = offload_dir
        self._lock = threading.Lock()  # one block at a time: the tiers are shared

    @property
    def tokenizer(self):
        """The model's tokenizer, for the frontends; loaded on first use (a checkpoint may ship none)."""
        if self._tokenizer is None:
            self._tokenizer = self.resolved.load_tokenizer()
        return self._tokenizer

    @property
    def config(self):
        return self.runtime.config

    @property
    def precision(self) -> str:
        return setting_name(self.policy, DTYPE_NAMES[self.runtime.devices.dtype])

    @classmethod
    def load(cls, model: str, policy: Policy | None = None, path: str | None = None, dummy: bool = False,
             offload_dir: str | os.PathLike | None = None, device: str | None = None, dtype: str | None = None,
             progress: bool = True) -> "Engine":
        policy = policy or Policy()
        keep_freed_host_memory()  # fresh pages for every big activation cost a third of a CPU prefill
        resolved = resolve(model, path=path, dummy=dummy)
        devices = pick_devices(device, dtype)
        offload = usable_offload_dir(offload_dir)  # before anything is loaded
        runtime = build_runtime(resolved, policy, devices, offload, progress)
        return cls(resolved, runtime, policy, offload)

    def set_policy(self, policy: Policy) -> None:
        """Run the next blocks under `policy` (a block planned for the requests at hand: its
        batch sizes, the cache's and activations' placement, overlap, delegation, prefix
        sharing). What loading fixed (FIXED_AT_LOAD) must stay as loaded: changing it would
        mean loading the model again."""
        check_keep_dense(policy.keep_dense_weights, self.config)
        problem = self.cannot_run(policy)
        if problem:
            raise FlexGenError(problem)
        with self._lock:
            self.policy = policy

    def cannot_run(self, policy: Policy) -> str | None:
        """Why this loaded engine cannot run under `policy` (it changes what loading fixed,
        FIXED_AT_LOAD); None where it can."""
        changed = [f for f in FIXED_AT_LOAD if getattr(policy, f) != getattr(self.policy, f)]
        if not changed:
            return None
        return (f"a loaded engine keeps its {', '.join(changed)} ({self.policy.describe()}); "
                f"{policy.describe()} needs the model loaded again")

    # ---- inputs ---------------------------------------------------------------------

    def check_prompts(self, prompts: list[list[int]]) -> list[list[int]]:
        """The prompts as lists of ints, each non-empty and inside the vocabulary."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            raise FlexGenError("prompts must be a list of token-id lists")
        if not prompts:
            raise FlexGenError("no prompts given")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)):
                raise FlexGenError(f"prompt {i} is text: the engine takes token ids "
                                   "(for text, use flexgen_helm.text.TextEngine)")
            ids = [int(t) for t in p]
            if not ids:
                raise FlexGenError(f"prompt {i} is empty (no tokens)")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise FlexGenError(f"prompt {i} has token ids outside the vocabulary "
                                   f"(0..{self.config.vocab_size - 1}): {bad[:5]}")
            out.append(ids)
        return out

    def _sequences(self, ids: list[list[int]], per_prompt: list[SamplingParams]) -> tuple[list[Sequence], list[int]]:
        """One Sequence per completion, and the index of the prompt each belongs to."""
        seqs, owners = [], []
        for i, (p, sp) in enumerate(zip(ids, per_prompt)):
            sp.validate()
            check_fits_context(self.config, f"prompt {i}", len(p), sp.max_new_tokens)
            stop_ids = set(sp.stop_token_ids)
            if not sp.ignore_eos and self.config.eos_token_id is not None:
                stop_ids.add(self.config.eos_token_id)
            base_seed = sp.seed if sp.seed is not None else next(_seed_counter) + torch.initial_seed()
            for c in range(sp.num_completions):
                gen = torch.Generator().manual_seed(base_seed + c) if sp.temperature > 0 else None
                seqs.append(Sequence(p, sp, gen, frozenset(stop_ids)))
                owners.append(i)
        return seqs, owners

    # ---- generation -----------------------------------------------------------------

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 on_step: StepCallback | None = None) -> GenerationRun:
        ids = self.check_prompts(prompts)
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(ids)
        if len(per_prompt) != len(ids):
            raise FlexGenError(f"{len(per_prompt)} sampling params for {len(ids)} prompts")
        seqs, owners = self._sequences(ids, per_prompt)
        with self._lock:
            stats = RunStats(sequences=len(seqs))
            with self._workdir() as workdir:
                BlockDriver(self.runtime, self.policy, Path(workdir), stats, self.stage_link(), on_step).generate(seqs)
            completions, stats = self.gather([s.completion() for s in seqs], stats)
            self._finish_stats(stats)
        results = [GenerationResult(prompt_token_ids=p) for p in ids]
        for owner, completion in zip(owners, completions):
            results[owner].completions.append(completion)
        return GenerationRun(results=results, stats=stats)

    def stage_link(self) -> StageLink:
        """How the driver's steps connect to the rest of the model: here it is all in this process."""
        return LocalStage()

    def gather(self, completions: list, stats: RunStats) -> tuple[list, RunStats]:
        """The completions and stats that every caller of this engine gets (a pipeline's come
        from its last stage); here, this process's own."""
        return completions, stats

    def score(self, prompts: list[list[int]], top_logprobs: int = 0, as_decode: bool = False,
              first_scored: list[int] | None = None) -> ScoreRun:
        """log p of every prompt token given the ones before it (HELM's echo, max_tokens=0).

        first_scored[i]: score prompt i's tokens from this index on (e.g. only a LAMBADA
        passage's last word); the earlier ones get nan and no top entries, and cost no head.

        as_decode: score each token as if the engine had generated it, attending through the
        KV cache (compressed and sparse as the policy says), instead of the fresh keys and
        values of one prefill; equal to a plain score without cache compression or sparsity."""
        ids = self.check_prompts(prompts)
        for i, p in enumerate(ids):
            check_fits_context(self.config, f"prompt {i}", len(p), 0)
        firsts = list(first_scored) if first_scored is not None else [1] * len(ids)
        if len(firsts) != len(ids) or any(not 1 <= f <= len(p) for f, p in zip(firsts, ids)):
            raise FlexGenError("first_scored needs one index per prompt, each from 1 to the prompt's token count")
        with self._lock:
            stats = RunStats(sequences=len(ids))
            with self._workdir() as workdir:
                driver = BlockDriver(self.runtime, self.policy, Path(workdir), stats)
                results: list[ScoreResult] = driver.score(ids, top_logprobs, as_decode, firsts)
            self._finish_stats(stats)
        return ScoreRun(results=results, stats=stats)

    # ---- bookkeeping ------------------------------------------------------------------

    def _workdir(self):
        try:
            self.offload_dir.mkdir(parents=True, exist_ok=True)
            return tempfile.TemporaryDirectory(prefix="run-", dir=self.offload_dir)
        except OSError as e:
            raise FlexGenError(f"offload directory {self.offload_dir} is not usable: {e}") from e

    def _finish_stats(self, stats: RunStats) -> None:
        stats.block_size = self.policy.block_size
        stats.memory = self.memory_report()

    def memory_report(self) -> dict:
        usage = self.runtime.usage.snapshot()
        report = {
            "tiers": usage,
            "placement": self.runtime.placement_report(),
            "cpu_peak_rss_bytes": process_peak_rss_bytes(),
            "disk_page_cache_bypass": bypass_mode(),
        }
        if self.runtime.devices.is_cuda:
            report["gpu_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.runtime.devices.compute)
        return report

    def close(self) -> None:
        self.runtime.release_dense_copies()
        self.runtime.homes.clear()


def build_runtime(resolved: ResolvedModel, policy: Policy, devices: Devices, offload_dir: Path,
                  progress: bool, layers: list | None = None) -> ModelRuntime:
    """`layers`: the part of the model this runtime runs (a pipeline stage); all by default."""
    cfg = resolved.config
    family = family_of(cfg)
    layers = layers if layers is not None else family.layer_specs(cfg)
    check_cache_compression(policy.compress_cache)
    check_keep_dense(policy.keep_dense_weights, cfg)
    check_sparse_attention(policy.attn_sparsity, cfg)
    specs = all_store_tensors(layers)
    # each weight's own setting: a GGUF's codes where the policy keeps them (weights/source_grids.py)
    compression = weight_grids(policy.compress_weight, resolved.source, specs)
    check_weight_compression(compression, [(t.store_name, t.shape) for t in specs])
    placement = place_weights(layers, policy.weights, compression)
    needs_disk = any(s.tier == "disk" for segs in placement.values() for s in segs)
    store, read_full = open_weights(resolved, devices.dtype, offload_dir, needs_disk, progress, compression,
                                   devices.compute, weight_calibration(resolved, policy.compress_weight, offload_dir,
                                                                       progress))
    usage = TierUsage()
    homes = build_homes(layers, placement, devices, read_full, usage, policy.pin_weight, compression,
                        progress, store if isinstance(store, CompressedStore) else None)
    release_freed_host_memory(0)  # what reading whole tensors to keep parts of them left behind
    runtime = ModelRuntime(cfg, family, layers, placement, homes, store, devices, usage, weight_compression=compression)
    seconds = runtime.make_dense_copies(policy)
    if seconds:
        logger.info("dense copies of the compressed weights made at load, kept for every block: %.0f MiB in %.2f s",
                    runtime.kept.nbytes / 2**20, seconds)
    return runtime


def weight_calibration(resolved: ResolvedModel, compression: Compression | None, offload_dir: Path,
                       progress: bool) -> LayerwiseGPTQ | None:
    """How a calibrated method (gptq) quantizes the weights, should its store be written;
    None for the others. Its calibration text is sampled from the model itself by an
    unquantized engine on the CPU (executor/calibration_text.py), in the CPU's compute dtype,
    which the layer-by-layer pass computes in too (bfloat16 where the CPU has bf16
    arithmetic: the sampling's decode steps read half the bytes of float32's)."""
    if compression is None or compression.method not in CALIBRATED_METHODS:
        return None
    devices = pick_devices("cpu")

    def sample(text: CalibrationText) -> list[list[int]]:
        policy = Policy(gpu_batch_size=text.sequences)
        runtime = build_runtime(resolved, policy, devices, offload_dir, progress)
        engine = Engine(resolved, runtime, policy, offload_dir)
        try:
            run = engine.generate(*text.requests(resolved.config))
        finally:
            engine.close()
        return [r.prompt_token_ids + r.completions[0].token_ids for r in run.results]

    return LayerwiseGPTQ(resolved.config, family_of(resolved.config), compression, sample, devices.dtype,
                         progress=progress)
