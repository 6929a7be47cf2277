"""The configurations the cost model is validated on: OPT-1.3B (dummy weights) under a
dozen policies, each checking one term of the model."""

from __future__ import annotations

from flexgen_helm.policy.policy import Compression, Policy, Split

MODEL = "facebook/opt-1.3b"
# The paper's 512 / 32 takes minutes per run on the 2 shared cores here; 256 / 16 keeps the
# whole table within the time we had (and still exercises prefill, decode and the cache).
PROMPT_LEN, GEN_LEN = 256, 16

_DISK = Split(0, 0, 1)

# name -> (policy, what it checks), most telling first (a measurement pass may be cut short)
CONFIGS: dict[str, tuple[Policy, str]] = {
    "ram-4x1": (Policy(4, 1), "all in the (host-memory) gpu tier"),
    "wdisk-4x1": (Policy(4, 1, weights=_DISK), "weights on disk"),
    "ram-2x4": (Policy(2, 4), "block shape: zig-zag over 4 GPU batches"),
    "ram-8x1": (Policy(8, 1), "block shape: bigger GPU batch"),
    "cdisk-4x1": (Policy(4, 1, cache=_DISK), "KV cache on disk, attention on the compute device"),
    "cdisk-4x1-deleg": (Policy(4, 1, cache=_DISK, cpu_cache_compute=True), "KV cache on disk, CPU delegation"),
    "whalf-4x1-nooverlap": (Policy(4, 1, weights=Split(0.5, 0, 0.5), overlap=False),
                            "half the weights on disk, no overlap (sum, not max)"),
    "ram-4x1-cw": (Policy(4, 1, compress_weight=Compression()), "4-bit weights in RAM (dequantized per use)"),
    "wdisk-4x1-cw": (Policy(4, 1, weights=_DISK, compress_weight=Compression()), "4-bit weights on disk"),
    "wdisk-4x2": (Policy(4, 2, weights=_DISK), "weights on disk, 2 GPU batches share each read"),
    "adisk-4x1": (Policy(4, 1, activations=_DISK), "activations on disk"),
    "cdisk-4x1-cc": (Policy(4, 1, cache=_DISK, compress_cache=Compression()), "4-bit KV cache on disk"),
    "cpu-tier-4x1": (Policy(4, 1, weights=Split(0, 1, 0), cache=Split(0, 1, 0), activations=Split(0, 1, 0)),
                     "cpu tier: used in place on a CPU-only machine"),
}
