"""The public Python API: load a model under a policy, then generate or score.

    engine = Engine.load("smollm2-135m", policy=Policy(...))
    results = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))
"""

from __future__ import annotations

import itertools
import os
import tempfile
import threading
from pathlib import Path

import torch

from flexgen_helm.compression.stored import check_weight_compression
from flexgen_helm.errors import FlexGenError, PromptTooLongError
from flexgen_helm.executor.generation import BlockRunner, RunStats, Sequence, plan_blocks, to_completion
from flexgen_helm.executor.kv_cache import check_cache_compression
from flexgen_helm.executor.runtime import ModelRuntime
from flexgen_helm.executor.sampling import GenerationResult, SamplingParams, ScoreResult
from flexgen_helm.memory.devices import Devices, pick_devices
from flexgen_helm.memory.direct_io import bypass_mode
from flexgen_helm.memory.host_allocator import keep_freed_host_memory
from flexgen_helm.memory.offload_dir import default_offload_dir
from flexgen_helm.memory.placement import place_weights
from flexgen_helm.memory.usage import TierUsage, process_peak_rss_bytes
from flexgen_helm.memory.weight_homes import build_homes
from flexgen_helm.models import family_of
from flexgen_helm.models.spec import all_store_tensors
from flexgen_helm.policy.policy import Policy
from flexgen_helm.weights.loading import open_weights
from flexgen_helm.weights.registry import ResolvedModel, resolve

_seed_counter = itertools.count()


class Engine:
    def __init__(self, resolved: ResolvedModel, runtime: ModelRuntime, policy: Policy, offload_dir: Path):
        self.resolved = resolved
        self.runtime = runtime
        self.policy = policy
        self._tokenizer = None
        self.offload_dir = offload_dir
        self.last_stats: dict = {}
        self._lock = threading.Lock()  # one block at a time: the tiers are shared

    @property
    def tokenizer(self):
        """Loaded on first use: token-id prompts need none (a checkpoint may ship none)."""
        if self._tokenizer is None:
            self._tokenizer = self.resolved.load_tokenizer()
        return self._tokenizer

    @property
    def config(self):
        return self.runtime.config

    @classmethod
    def load(cls, model: str, policy: Policy | None = None, path: str | None = None, dummy: bool = False,
             offload_dir: str | os.PathLike | None = None, device: str | None = None, dtype: str | None = None,
             progress: bool = True) -> "Engine":
        policy = policy or Policy()
        keep_freed_host_memory()  # fresh pages for every big activation cost a third of a CPU prefill
        resolved = resolve(model, path=path, dummy=dummy)
        devices = pick_devices(device, dtype)
        offload = Path(offload_dir) if offload_dir else default_offload_dir()
        runtime = build_runtime(resolved, policy, devices, offload, progress)
        return cls(resolved, runtime, policy, offload)

    # ---- inputs ---------------------------------------------------------------------

    def encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            raise FlexGenError("prompts must be a list of strings or a list of token-id lists")
        if not prompts:
            raise FlexGenError("no prompts given")
        out = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer(p)["input_ids"] if isinstance(p, str) else [int(t) for t in p]
            if not ids:
                raise FlexGenError(f"prompt {i} is empty (no tokens)")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise FlexGenError(f"prompt {i} has token ids outside the vocabulary (0..{self.config.vocab_size - 1}): {bad[:5]}")
            out.append(ids)
        return out

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _check_length(self, i: int, n_prompt: int, n_new: int) -> None:
        if n_prompt + n_new > self.config.max_seq_len:
            raise PromptTooLongError(
                f"prompt {i} has {n_prompt} tokens; with {n_new} new tokens that is {n_prompt + n_new}, more than "
                f"the context of {self.config.name} ({self.config.max_seq_len} tokens)"
            )

    # ---- generation -----------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        ids = self.encode(prompts)
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(ids)
        if len(per_prompt) != len(ids):
            raise FlexGenError(f"{len(per_prompt)} sampling params for {len(ids)} prompts")
        seqs, owners = [], []
        for i, (p, sp) in enumerate(zip(ids, per_prompt)):
            sp.validate()
            self._check_length(i, len(p), sp.max_new_tokens)
            stop_ids = set(sp.stop_token_ids)
            if not sp.ignore_eos and self.config.eos_token_id is not None:
                stop_ids.add(self.config.eos_token_id)
            base_seed = sp.seed if sp.seed is not None else next(_seed_counter) + torch.initial_seed()
            for c in range(sp.num_completions):
                gen = torch.Generator().manual_seed(base_seed + c) if sp.temperature > 0 else None
                seqs.append(Sequence(p, sp, gen, frozenset(stop_ids)))
                owners.append(i)
        with self._lock:
            stats = RunStats(sequences=len(seqs))
            with self._workdir() as workdir:
                self._run_blocks(seqs, stats, Path(workdir))
            self._finish_stats(stats)
        results = [GenerationResult(prompt_token_ids=p) for p in ids]
        for owner, s in zip(owners, seqs):
            results[owner].completions.append(to_completion(s, self.decode))
        return results

    def _run_blocks(self, seqs: list[Sequence], stats: RunStats, workdir: Path) -> None:
        runner = BlockRunner(self.runtime, self.policy, self.decode, workdir, stats)
        for block in plan_blocks([len(s.prompt) for s in seqs], self.policy):
            runner.generate([[seqs[i] for i in group] for group in block])

    def score(self, prompts, top_logprobs: int = 0, as_decode: bool = False,
              first_scored: list[int] | None = None) -> list[ScoreResult]:
        """log p of every prompt token given the ones before it (HELM's echo, max_tokens=0).

        first_scored[i]: score prompt i's tokens from this index on (e.g. only a LAMBADA
        passage's last word); the earlier ones get nan and no top entries, and cost no head.

        as_decode: score each token as if the engine had generated it, attending through the
        KV cache (compressed and sparse as the policy says), instead of the fresh keys and
        values of one prefill; equal to a plain score without cache compression or sparsity."""
        ids = self.encode(prompts)
        for i, p in enumerate(ids):
            self._check_length(i, len(p), 0)
        firsts = list(first_scored) if first_scored is not None else [1] * len(ids)
        if len(firsts) != len(ids) or any(not 1 <= f <= len(p) for f, p in zip(firsts, ids)):
            raise FlexGenError("first_scored needs one index per prompt, each from 1 to the prompt's token count")
        out: list[ScoreResult | None] = [None] * len(ids)
        with self._lock:
            stats = RunStats(sequences=len(ids))
            with self._workdir() as workdir:
                runner = BlockRunner(self.runtime, self.policy, self.decode, Path(workdir), stats)
                for block in plan_blocks([len(p) for p in ids], self.policy):
                    flat = [i for group in block for i in group]
                    for i, (lps, top) in zip(flat, runner.score([ids[i] for i in flat], top_logprobs, as_decode,
                                                                  [firsts[i] for i in flat])):
                        out[i] = ScoreResult(token_ids=ids[i], logprobs=lps, top_logprobs=top)
            self._finish_stats(stats)
        return out

    # ---- bookkeeping ------------------------------------------------------------------

    def _workdir(self):
        try:
            self.offload_dir.mkdir(parents=True, exist_ok=True)
            return tempfile.TemporaryDirectory(prefix="run-", dir=self.offload_dir)
        except OSError as e:
            raise FlexGenError(f"offload directory {self.offload_dir} is not usable: {e}") from e

    def _finish_stats(self, stats: RunStats) -> None:
        d = stats.as_dict()
        d["batch_size"] = self.policy.block_size
        d["memory"] = self.memory_report()
        self.last_stats = d

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
        self.runtime.homes.clear()


def build_runtime(resolved: ResolvedModel, policy: Policy, devices: Devices, offload_dir: Path,
                  progress: bool, layers: list | None = None) -> ModelRuntime:
    """`layers`: the part of the model this runtime runs (a pipeline stage); all by default."""
    cfg = resolved.config
    family = family_of(cfg)
    layers = layers if layers is not None else family.layer_specs(cfg)
    check_cache_compression(policy.compress_cache)
    check_weight_compression(policy.compress_weight, [t.shape for t in all_store_tensors(layers)])
    placement = place_weights(layers, policy.weights, policy.compress_weight)
    needs_disk = any(s.tier == "disk" for segs in placement.values() for s in segs)
    store, read_full = open_weights(resolved, devices.dtype, offload_dir, needs_disk, progress, policy.compress_weight,
                                   devices.compute)
    usage = TierUsage()
    homes = build_homes(layers, placement, devices, read_full, usage, policy.pin_weight, policy.compress_weight,
                        progress)
    return ModelRuntime(cfg, family, layers, placement, homes, store, devices, usage)
