"""Which way a step's transfers run beside compute, from the policy alone: inline, on the copy
engine's worker threads, or on a GPU's streams from the compute thread (memory/copy_engine.py).
The schedule runs them so and the cost model prices them so (a worker's hand-off per transfer)."""

from __future__ import annotations

from flexgen_helm.memory.copy_engine import cuda_copies
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.policy.policy import Policy


def anything_on_disk(policy: Policy) -> bool:
    return any(split.disk > 0 for split in (policy.weights, policy.cache, policy.activations))


def anything_to_overlap(policy: Policy, is_cuda: bool) -> bool:
    """Transfers overlap compute only where another engine does them: a GPU's copy engine,
    or the disk. On a CPU-only machine with nothing on disk every transfer is a memcpy by
    the cores that compute, and a copy thread only competes with them: SmolLM2-135M, 64 x
    100 tokens + 8 generated, bfloat16, 2 cores: 2.95 s with the thread, 2.25 s inline
    (decode 1.16 -> 0.69 s)."""
    return is_cuda or anything_on_disk(policy)


def copies_on_streams(policy: Policy, cfg: ModelConfig, is_cuda: bool) -> bool:
    """Whether a GPU's transfers go on the lanes' streams from the compute thread, not through
    worker threads (memory/copy_engine.py: FLEXGEN_HELM_CUDA_COPIES=streams, the default). Not
    with anything on disk, whose reads block the thread that makes them; nor where the host
    itself reads the cache a lane stored in RAM, which a worker's wait for each copy orders
    after the stores: CPU delegation's attention in place, and, on the cpu tier, a sliding
    window's ring gathered and KIVI's groups regrouped."""
    cc = policy.compress_cache
    host_reads_ram = policy.cpu_cache_compute or policy.cache.cpu > 0 and (
        (cc is not None and cc.kivi) or any(cfg.window(i) for i in range(cfg.num_layers)))
    return cuda_copies() == "streams" and is_cuda and not anything_on_disk(policy) and not host_reads_ram


def transfers_on_threads(policy: Policy, cfg: ModelConfig, is_cuda: bool) -> bool:
    """Whether the copy engine's worker threads carry the step's transfers (each one handed
    to a worker and waited for)."""
    return (policy.overlap and anything_to_overlap(policy, is_cuda)
            and not copies_on_streams(policy, cfg, is_cuda))
