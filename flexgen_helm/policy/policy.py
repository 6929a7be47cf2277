"""The placement and batching policy: plain data, validated on construction."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from flexgen_helm.errors import PolicyError

TIERS = ("gpu", "cpu", "disk")


@dataclass(frozen=True)
class Split:
    """Fractions (0..1) of one kind of tensor on each tier; they sum to 1."""

    gpu: float = 1.0
    cpu: float = 0.0
    disk: float = 0.0

    @classmethod
    def from_percent(cls, gpu: float, cpu: float) -> "Split":
        return cls(gpu / 100.0, cpu / 100.0, max(0.0, (100.0 - gpu - cpu) / 100.0))

    def as_tuple(self) -> tuple[float, float, float]:
        return (self.gpu, self.cpu, self.disk)

    def tiers(self) -> tuple[str, ...]:
        """The tiers holding a share."""
        return tuple(t for t, f in zip(TIERS, self.as_tuple()) if f > 0)

    def validate(self, what: str) -> None:
        for tier, f in zip(TIERS, self.as_tuple()):
            if not 0.0 <= f <= 1.0:
                raise PolicyError(f"{what}: the {tier} fraction {f:g} is outside [0, 1] (percent: 0 to 100)")
        total = sum(self.as_tuple())
        if abs(total - 1.0) > 1e-6:
            raise PolicyError(
                f"{what}: fractions gpu={self.gpu:g} cpu={self.cpu:g} disk={self.disk:g} sum to {total:g}, not 1 (100%)"
            )


# How a group's scale and minimum are chosen (compression/quantize.py, compression/hqq.py):
# "rtn" = FlexGen's min/max round-to-nearest; "hqq" = fitted to minimize the group's
# reconstruction error (half-quadratic), computed once at conversion; "gptq" = the codes
# chosen against calibration inputs with error feedback (compression/gptq.py), weights
# only, computed once at conversion; "gguf" = a GGUF file's own codes, scales and minimums
# taken as they are where its tensor types hold them on groups of 32 (weights/gguf_codes.py),
# each weight at its file's width; the others re-quantized by min/max onto bits / group_size,
# with a log line (weights/source_grids.py).
QUANT_METHODS = ("rtn", "hqq", "gptq", "gguf")
# methods that need the inputs a weight will see: a KV cache, quantized as it is written, has none
CALIBRATED_METHODS = ("gptq",)
# methods that take codes a weight source already holds: a KV cache, computed as it runs, has none
SOURCE_CODE_METHODS = ("gguf",)
# Which values of a quantized KV cache share a group (executor/kv_cache.py, kivi_cache.py):
# "per-token" = each position's head_dim row on its own (FlexGen); "kivi" = keys per channel
# over blocks of group_size tokens and values per token, the newest tokens of an unfinished
# block kept in full precision (KIVI, Liu et al. 2024). The default is the one that measured
# better (runs/accuracy/README.md, "4-bit KV cache grouping").
CACHE_GROUPINGS = ("per-token", "kivi")
DEFAULT_CACHE_GROUPING = "kivi"
# group_size of a weight compression whose groups are whole rows: one scale and minimum per
# output channel (the grid of torch's int8 weight-only matmul, compression/int8.py)
PER_CHANNEL = -1


@dataclass(frozen=True)
class Compression:
    """Group-wise asymmetric quantization (FlexGen Section 5): min/max by default."""

    bits: int = 4
    group_size: int = 64
    group_dim: int | None = None  # None: the default for the tensor kind (weights dim 1, cache head dim)
    method: str = "rtn"  # one of QUANT_METHODS
    cache_grouping: str | None = None  # a KV cache's: one of CACHE_GROUPINGS; None: DEFAULT_CACHE_GROUPING

    @property
    def kivi(self) -> bool:
        """Whether a KV cache under this setting groups its keys per channel (KIVI)."""
        return (self.cache_grouping or DEFAULT_CACHE_GROUPING) == "kivi"

    def validate(self, what: str) -> None:
        if not 2 <= self.bits <= 8:
            raise PolicyError(f"{what}: {self.bits} bits is outside the supported 2..8")
        if self.group_size < 1 and self.group_size != PER_CHANNEL:
            raise PolicyError(f"{what}: group size must be positive (or {PER_CHANNEL}: one group per output "
                              f"channel, weights only), got {self.group_size}")
        if self.group_size == PER_CHANNEL and self.group_dim not in (None, 1):
            raise PolicyError(f"{what}: group size {PER_CHANNEL} (per output channel) groups along dim 1, "
                              f"not {self.group_dim}")
        if self.group_size == PER_CHANNEL and self.method not in ("rtn", "hqq"):
            raise PolicyError(f"{what}: group size {PER_CHANNEL} (per output channel) takes rtn or hqq, "
                              f"not {self.method}")
        if self.method not in QUANT_METHODS:
            raise PolicyError(f"{what}: unknown quantization method {self.method!r} "
                              f"(choose from {', '.join(QUANT_METHODS)})")
        if self.cache_grouping is not None and self.cache_grouping not in CACHE_GROUPINGS:
            raise PolicyError(f"{what}: unknown cache grouping {self.cache_grouping!r} "
                              f"(choose from {', '.join(CACHE_GROUPINGS)})")


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 1
    num_gpu_batches: int = 1
    weights: Split = field(default_factory=Split)
    cache: Split = field(default_factory=Split)
    activations: Split = field(default_factory=Split)
    overlap: bool = True
    cpu_cache_compute: bool = False
    pin_weight: bool = True
    compress_weight: Compression | None = None
    compress_cache: Compression | None = None
    attn_sparsity: float = 1.0  # fraction of keys kept in decode attention; 1 = dense
    # a block computes the prompt tokens all its sequences start with once (executor/shared_prefix.py)
    prefix_sharing: bool = True
    # a block keeps each layer's compressed weights dequantized from their first use to its end
    # (and for the blocks after it, where every weight is on the compute tier:
    # dense_copies_across_blocks; then the load makes them all), so that its decode steps
    # multiply dense copies (the speed of uncompressed weights, at their memory) instead of the
    # int4/int8 kernels, which are slower than a dense matmul at a decode step's few rows on
    # some CPUs (runs/compression_8bit/decode_paths/); the planner turns it on where the compute
    # tier holds every dense copy (executor/schedule.py)
    keep_dense_weights: bool = False
    # a compressed cache's values held dense, so that a decode step does not dequantize every
    # held position again (runs/compression_8bit/decode_paths/); every number is the compressed
    # cache's (but in a 16-bit dtype on a CPU, below). Stored like an uncompressed cache, which
    # attention reads in place (the memory and bytes moved of a dense cache), its writes rounded
    # (rounds_cache_writes): per-token groups each position as it is written; KIVI, whose keys
    # round per group of tokens, each unit's group in place once its G positions are written
    # (the positions of its unfinished group as computed, as KIVI's full-precision residual keeps
    # them), so KIVI's only in memory, not on disk. Stored in the compute dtype, where the
    # compressed cache dequantizes to what CPU attention reads (float32), so in bf16/fp16 on a
    # CPU each held value is the compressed cache's rounded once more to the 16-bit dtype (2^-9
    # of it in bf16, against a 4-bit grid's 1/15 of a group's range): the main job's 4-bit and
    # 8-bit deployments' decode ran 1.4x and 1.2x faster so (runs/compression_8bit). The
    # planner turns it on where the budgets hold it and its estimate is faster
    keep_dense_cache: bool = False

    def __post_init__(self):
        self.validate()

    @property
    def cache_storage(self) -> Compression | None:
        """The compression the KV cache is stored in (None: dense, its values maybe rounded:
        keep_dense_cache)."""
        return None if self.rounds_cache_writes else self.compress_cache

    @property
    def rounds_cache_writes(self) -> bool:
        """A compressed cache held dense: its writes rounded to the grid (KIVI: each group once
        complete), stored dense."""
        return self.keep_dense_cache

    @property
    def dense_copies_across_blocks(self) -> bool:
        """Whether dense copies of weights a block keeps serve the blocks after it: every weight
        in the compute tier's memory, where a layer's load is its home (executor/runtime.py)."""
        return self.weights.gpu == 1.0

    @property
    def cache_dequantized_per_step(self) -> bool:
        """Whether a decode step dequantizes every held position of the cache (compressed, and
        not held dense)."""
        return self.compress_cache is not None and not self.keep_dense_cache

    @property
    def block_size(self) -> int:
        """Sequences in one block of the zig-zag schedule (the effective batch size)."""
        return self.gpu_batch_size * self.num_gpu_batches

    def validate(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PolicyError(f"{name} must be a positive integer, got {v!r}")
        self.weights.validate("weights placement")
        self.cache.validate("KV cache placement")
        self.activations.validate("activations placement")
        for name in ("compress_weight", "compress_cache"):
            c = getattr(self, name)
            if c is not None:
                c.validate(name)
        if self.compress_weight is not None and self.compress_weight.cache_grouping is not None:
            raise PolicyError(f"compress_weight: cache_grouping {self.compress_weight.cache_grouping!r} is a KV "
                              "cache setting; weights are grouped along group_dim")
        if self.compress_cache is not None and self.compress_cache.group_size == PER_CHANNEL:
            raise PolicyError(f"compress_cache: group size {PER_CHANNEL} (one group per output channel) is for "
                              "weights; a KV cache takes a positive group size")
        if self.compress_cache is not None and self.compress_cache.method in SOURCE_CODE_METHODS:
            raise PolicyError(f"compress_cache: {self.compress_cache.method} takes a weight file's own codes; a KV "
                              "cache is quantized as it is written: give it rtn or hqq")
        if self.compress_cache is not None and self.compress_cache.method in CALIBRATED_METHODS:
            raise PolicyError(f"compress_cache: {self.compress_cache.method} quantizes weights against calibration "
                              "inputs; a KV cache is quantized as it is written: give it rtn or hqq (a policy "
                              "file sets the weights' and the cache's methods apart)")
        if self.keep_dense_weights and self.compress_weight is None:
            raise PolicyError("keep_dense_weights keeps the dense copies of compressed weights, but compress_weight is "
                              "not set")
        if self.keep_dense_weights and self.weights.disk > 0:
            raise PolicyError(f"keep_dense_weights: the weights are {100 * self.weights.disk:g}% on disk; dense copies "
                              "kept for a whole block are for weights held in memory (place them on the gpu/cpu tiers)")
        if self.keep_dense_cache and self.compress_cache is None:
            raise PolicyError("keep_dense_cache holds a compressed cache's values dense, but compress_cache is not set")
        if self.keep_dense_cache and self.compress_cache.kivi and self.cache.disk > 0:
            raise PolicyError(f"keep_dense_cache: a KIVI cache held dense rounds each group in place once it is "
                              f"complete, in memory, but the cache is {100 * self.cache.disk:g}% on disk: place it on "
                              "the gpu/cpu tiers, use per-token cache grouping, or drop keep_dense_cache")
        if not 0.0 < self.attn_sparsity <= 1.0:
            raise PolicyError(f"attn_sparsity must be in (0, 1], got {self.attn_sparsity}")

    @classmethod
    def from_percent(cls, percent, **kwargs) -> "Policy":
        """FlexGen's `--percent`: six numbers, weights gpu/cpu, cache gpu/cpu, activations gpu/cpu."""
        if len(percent) != 6:
            raise PolicyError("--percent takes six numbers (weights, cache, activations: gpu then cpu), "
                              f"got {len(percent)}")
        for p in percent:
            if not 0 <= p <= 100:
                raise PolicyError(f"--percent values must be within 0..100, got {p}")
        for i, what in zip((0, 2, 4), ("weights", "KV cache", "activations")):
            if percent[i] + percent[i + 1] > 100:
                raise PolicyError(f"--percent for {what}: gpu {percent[i]} + cpu {percent[i + 1]} exceeds 100")
        w, c, a = (Split.from_percent(percent[i], percent[i + 1]) for i in (0, 2, 4))
        return cls(weights=w, cache=c, activations=a, **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Policy":
        d = dict(d)
        for k in ("weights", "cache", "activations"):
            if isinstance(d.get(k), dict):
                d[k] = Split(**d[k])
        for k in ("compress_weight", "compress_cache"):
            if isinstance(d.get(k), dict):
                d[k] = Compression(**d[k])
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise PolicyError(f"unknown policy fields: {', '.join(sorted(unknown))}")
        return cls(**d)

    def describe(self) -> str:
        pct = lambda s: "/".join(f"{100 * f:g}" for f in s.as_tuple())  # noqa: E731
        return (
            f"gbs={self.gpu_batch_size} x nb={self.num_gpu_batches}, weights {pct(self.weights)}, "
            f"cache {pct(self.cache)}, act {pct(self.activations)} (gpu/cpu/disk %), "
            f"overlap={'on' if self.overlap else 'off'}, cpu_cache_compute={'on' if self.cpu_cache_compute else 'off'}"
            + (", dense copies of the weights kept" if self.keep_dense_weights else "")
            + (", the compressed cache's values held dense" if self.keep_dense_cache else "")
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())
