"""FlexGen's cost model (paper, Appendix A.2) for this engine.

Per layer and phase the time is the max over five resources, which overlap (Algorithm 1):

    cpu_gpu   host -> compute-device copies (on a CPU-only machine: memcpy within RAM)
    gpu_cpu   compute-device -> host copies (CPU-only: memcpy, e.g. KV-cache stores)
    disk_cpu  disk reads, page cache bypassed (O_DIRECT)
    cpu_disk  disk writes
    compute   linear layers + attention (+ CPU-delegated attention) + dequantization + elementwise
              passes + the engine's profiled fixed cost per layer and GPU batch; on a CPU-only
              machine also the two memcpy terms above, which the computing cores make themselves
              (so they add to compute instead of overlapping), and there disk transfers overlap
              compute only in part (the same cores serve them: HardwareProfile.disk_overlap_loss),
              which the compute and disk terms each carry

(the sum instead of the max when the policy turns overlap off). The terms sum over the
block's GPU batches, except weights, which a layer loads once per step for the whole block.

    prefill = sum over layers of layer_time(prompt of s tokens) + fixed cost of a step
    decode  = sum over layers of layer_time(one token, KV cache of the average length s + n/2) + fixed cost of a step
    total   = prefill + (n - 1) * decode;   throughput = block_size * n / total

Every term is affine in the nine placement fractions (wg, wc, wd, cg, cc, cd, hg, hc, hd)
up to the engine's rounding of placements to rows: policy/search.py reads the LP's
coefficients by evaluating this model at the placements where each kind of tensor sits on
one tier (where rounding does not exist), so the formulas live here only.

How this engine moves data (memory/weight_homes.load_home, executor/kv_cache.py,
executor/activations.py):
- a weight wholly on a tier of the compute device's memory is used in place (on a CPU-only
  machine that is the gpu *and* the cpu tier); a weight split over tiers is assembled by
  copying every part; a weight on disk is read (on CUDA then copied to the GPU);
- the KV cache of a tier is read where it lives; with CPU delegation the cpu/disk parts are
  attended on the CPU and only q and the attention output cross the link;
- a KV-cache store copies into preallocated slots (a memcpy even on the gpu tier of a
  CPU-only machine); activations on the compute device's memory move for free.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from flexgen_helm.compression.grids import WeightCompression, WeightGrids, tensor_compression
from flexgen_helm.compression.int8 import LAYOUT as INT8_LAYOUT
from flexgen_helm.compression.stored import weight_groups, weight_layout
from flexgen_helm.errors import ProfileFormatError
from flexgen_helm.executor.attention import decode_cache_dtype
from flexgen_helm.executor.cache_buffers import load_group, unpacks_on_lane
from flexgen_helm.executor.expert_weights import EXPERTS_IN_FLIGHT, expert_of
from flexgen_helm.executor.held_prefix import reads_prefix_as_stored, unpacked_nbytes
from flexgen_helm.executor.kv_cache import (
    cache_rows,
    held_out_prefix,
    kv_nbytes,
    kv_nbytes_per_position,
    rounded_group_rows,
)
from flexgen_helm.executor.transfer_ways import transfers_on_threads
from flexgen_helm.executor.working_set import (
    batch_working_bytes,
    decode_head_rows,
    decode_head_work,
    dense_weight_numel,
    kept_freed_bytes,
)
from flexgen_helm.memory.devices import DTYPES
from flexgen_helm.memory.placement import place_weights
from flexgen_helm.memory.weight_homes import load_nbytes, segment_nbytes
from flexgen_helm.models import family_of
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.moe import expected_experts_touched
from flexgen_helm.models.spec import LayerSpec, TensorSpec, is_lookup_table
from flexgen_helm.planner.budget import planned_components
from flexgen_helm.planner.hardware_profile import HardwareProfile
from flexgen_helm.policy.policy import TIERS, Policy

TERMS = ("cpu_gpu", "gpu_cpu", "disk_cpu", "cpu_disk", "compute")
PHASES = ("prefill", "decode")
OPS_PER_BLOCK = 30  # kernels one transformer block launches per GPU batch (norms, linears, attention, adds)
OPS_PER_OTHER_LAYER = 6  # embedding or head
TRANSFERS_PER_LAYER_BATCH = 4  # the schedule's loads (cache, hidden) and stores (cache, hidden) per layer and batch
ATTENTION_MASK_BYTES = 1  # per score element in `attend`: fused attention keeps only a bool mask (padding)
# Elementwise passes a block makes over its activations, per token, counted in models/<family>.py
# and executor/: (per hidden-size element, per MLP-width element). OPT: two layer norms (~2.5
# passes each), two residual adds, the attention output's reshape, the K/V cache write (2), the
# hidden-state store; ReLU over the MLP. Llama (and Phi-3): two RMS norms in float32 (~5 passes
# each), rotary embedding of q and k (~5), residual adds, reshapes, cache write, store; SiLU and the
# gate product. Gemma: Llama's plus two more norms (~5 each, (1 + w) in float32), the embedding
# scale and the query's rescale (~1 each); tanh GELU (~3) and the gate product over the MLP.
ELEMENTWISE_PASSES = {"opt": (12.0, 1.0), "llama": (22.0, 2.0), "phi3": (22.0, 2.0), "gemma": (34.0, 4.0)}
# A model with q/k norms (ModelConfig.qk_norm: Qwen3, Gemma 3, OLMoE, Qwen3-MoE) adds an RMS
# norm (~5 passes, as above) over every query and key element: (heads + kv_heads) x head_dim
# a token, whether per head or over the whole projection (OLMoE). Measured at OLMoE's shapes,
# an RMS norm took 5.8-6.3 plain passes (runs/bench/elementwise_passes).
QK_NORM_PASSES = 5.0
# A sparse MoE block's passes over the hidden size per (token, chosen expert), models/moe.expert_mlp:
# the row gathered for its expert (index_select: a read and a write), the expert's output times
# its routing weight (a read and a write), and added back to its token (index_add_: a read).
# On OLMoE-1B-7B (k = 8) that is 40 passes of the hidden size a token, about as many as the rest
# of the block's elementwise work. In a 4-bit OLMoE prefill (16 x 512 tokens, the compare's) that
# work, with the sort and the routing, took 1.2 s of 26.4 (cProfile, 2026-11-28); at the
# profile's rate of a plain pass these passes price 0.6 s (index_select and index_add_ are slower).
EXPERT_ROUTING_PASSES = 5.0
# What an MoE block's call costs for each expert its rows choose, besides the arithmetic, where
# the hardware profile has not measured it (planner/overhead_profile.py: per_expert): the ops of
# models/moe._expert and its bookkeeping (the rows' slice, three products, the activation and
# gate product, the copy of its outputs, its load and release), at the tiny-op latency.
EXPERT_CALL_OPS = 10


@dataclass(frozen=True)
class Fractions:
    """The LP's variables: weights, KV cache, activations on gpu / cpu / disk."""

    wg: float = 1.0
    wc: float = 0.0
    wd: float = 0.0
    cg: float = 1.0
    cc: float = 0.0
    cd: float = 0.0
    hg: float = 1.0
    hc: float = 0.0
    hd: float = 0.0

    NAMES = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd")

    @classmethod
    def of(cls, policy: Policy) -> "Fractions":
        return cls(*policy.weights.as_tuple(), *policy.cache.as_tuple(), *policy.activations.as_tuple())

    @classmethod
    def from_vector(cls, v) -> "Fractions":
        return cls(*(float(x) for x in v))

    def splits(self) -> tuple[dict, dict, dict]:
        return ({"gpu": self.wg, "cpu": self.wc, "disk": self.wd}, {"gpu": self.cg, "cpu": self.cc, "disk": self.cd},
                {"gpu": self.hg, "cpu": self.hc, "disk": self.hd})


# Bytes a decode step moves per score of a query against the shared prefix besides its two
# matmuls (attention.attend_past_shared_prefix: the scores widened to float32, their max,
# exp, the weights narrowed for the second matmul and summed): five passes of 4 bytes or so,
# which matches SmolLM2's 8.6 M prefix scores a step costing ~15 ms beside ~5 ms of matmuls
# (runs/prefix_sharing/README.md, decode_step.py).
PREFIX_SCORE_BYTES = 20


@dataclass(frozen=True)
class Workload:
    prompt_len: int
    gen_len: int
    shared_prefix: int = 0  # tokens every prompt of a block starts with (executor/shared_prefix.py)

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def mean_decode_len(self) -> float:
        """Average cache length a decode step reads: s + 1 ... s + n - 1 (plus the new token)."""
        return self.prompt_len + self.gen_len / 2


@dataclass
class Estimate:
    """The cost model's answer for one policy."""

    prefill_terms: dict[str, float]  # seconds per term, summed over layers (each layer's max picks its bottleneck)
    decode_terms: dict[str, float]  # per decode step
    prefill_s: float
    decode_step_s: float
    total_s: float
    throughput: float  # generated tokens / s
    block_size: int
    peak_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> tier -> bytes
    accounted_bytes: dict[str, int] = field(default_factory=dict)  # what the engine's TierUsage counts
    bottleneck: dict[str, str] = field(default_factory=dict)  # phase -> the term that dominates most

    def describe(self) -> str:
        def row(name, terms):
            return f"  {name:8s}" + " ".join(f"{t}={v:9.3f}s" for t, v in terms.items())
        gib = 2**30
        return "\n".join([
            f"predicted: {self.throughput:.2f} token/s; block latency {self.total_s:.2f} s "
            f"(prefill {self.prefill_s:.2f} s + decode {self.decode_step_s:.3f} s/step)",
            "per-resource time (summed over layers):",
            row("prefill", self.prefill_terms),
            row("decode", self.decode_terms),
            f"bottleneck: prefill {self.bottleneck.get('prefill')}, decode {self.bottleneck.get('decode')}",
            "peak memory: " + ", ".join(f"{t} {max(p[t] for p in self.peak_bytes.values()) / gib:.2f} GiB"
                                         for t in TIERS),
        ])


# ---- what one layer moves and computes ----------------------------------------------------

def _is_matrix(t: TensorSpec) -> bool:
    return len(t.shape) >= 2


@dataclass
class LayerWeights:
    """Bytes of one layer's weights by tier as the layer loads them (tied tensors included),
    and the elements its math uses them by."""

    stored: dict[str, float]  # tier -> bytes stored there (compressed if compressed)
    disk_reads: float  # separate reads (each pays the disk latency)
    assembled: float  # bytes copied to assemble tensors split over tiers
    # key -> bytes a load of the tensor makes besides its homes: what it reads off disk, the copy
    # that assembles it when split over tiers, and on a GPU what it copies from host memory
    loaded: dict[str, float] = field(default_factory=dict)
    matmul_numel: int = 0  # elements of the weights used in matmuls
    # under weight compression (else 0): elements of the layer's compressed matrices
    packed_matmul_numel: int = 0  # multiplied, in the int4 kernel's layout: the kernel may take them
    packed_numel: int = 0  # in the kernel's layout, lookups too: dequantized where the kernel is not used
    grouped_numel: int = 0  # in the group layout (QuantizedTensor): dequantized at every load
    grouped_matmul_numel: int = 0  # of those, multiplied (not looked up)
    # of those, in the int8 kernel's layout (8 bits per output channel): the int8 kernel may take them
    int8_matmul_numel: int = 0
    # elements of a row of the tables in the CPU's packed layout, of which a lookup dequantizes
    # only the rows it looks up (CompressedWeight.embedding); not in packed_numel
    row_lookup_width: int = 0
    # the same for tables in the int8 layout or in groups along their rows: not in grouped_numel
    grouped_lookup_width: int = 0
    # a sparse MoE block's experts alone (included in the fields above): a step loads only those
    # its tokens choose (executor/expert_weights.py), and each row multiplies k of them
    experts: "LayerWeights | None" = None

    def scaled(self, share: float) -> "LayerWeights":
        """Every amount times `share` (the experts part dropped)."""
        return LayerWeights({t: v * share for t, v in self.stored.items()},
                            loaded={k: v * share for k, v in self.loaded.items()},
                            **{f: getattr(self, f) * share for f in _AMOUNTS})

    def plus(self, other: "LayerWeights") -> "LayerWeights":
        """The amounts of both added (the experts part dropped)."""
        return LayerWeights({t: v + other.stored[t] for t, v in self.stored.items()},
                            loaded={k: self.loaded.get(k, 0.0) + other.loaded.get(k, 0.0)
                                    for k in {**self.loaded, **other.loaded}},
                            **{f: getattr(self, f) + getattr(other, f) for f in _AMOUNTS})


_AMOUNTS = ("disk_reads", "assembled", "matmul_numel", "packed_matmul_numel", "packed_numel", "grouped_numel",
            "grouped_matmul_numel", "int8_matmul_numel", "row_lookup_width", "grouped_lookup_width")


def layer_weights(layer: LayerSpec, placement: dict, weight_compression: WeightCompression, dtype: torch.dtype,
                  device: torch.device) -> LayerWeights:
    """From the engine's own placement (rounded to rows, or to quantization groups) and its
    choice of layout for `device` computing in `dtype` (compression.stored.weight_layout)."""
    lw = LayerWeights({t: 0.0 for t in TIERS}, 0.0, 0.0)
    for t in layer.tensors:
        compression = tensor_compression(weight_compression, t.store_name, t.shape)
        segments = placement[t.store_name]
        lw.loaded[t.key] = load_nbytes(t, segments, compression, dtype, device.type == "cuda")
        for s in segments:
            nbytes = segment_nbytes(t, s, compression, dtype)
            lw.stored[s.tier] += nbytes
            lw.disk_reads += s.tier == "disk"
            if len(segments) > 1:
                lw.assembled += nbytes
        if not _is_matrix(t):
            continue
        multiplied = not is_lookup_table(layer, t.key)
        lw.matmul_numel += t.numel * multiplied
        if weight_groups(compression, t.shape) is None:
            continue
        layout = weight_layout(compression, t.shape, dtype, device)
        if layout == "cpu" and not multiplied:
            lw.row_lookup_width += t.row_numel
        elif not multiplied and (layout == INT8_LAYOUT
                                 or (layout is None and weight_groups(compression, t.shape) == 1)):
            # the int8 layout and groups along a row decode a row apart: a lookup dequantizes
            # only the rows it looks up (CompressedWeight.embedding)
            lw.grouped_lookup_width += t.row_numel
        elif layout is not None and layout != INT8_LAYOUT:
            lw.packed_numel += t.numel
            lw.packed_matmul_numel += t.numel * multiplied
        else:  # groups (dequantized per load) or the int8 layout, which the int8 kernel may take
            lw.grouped_numel += t.numel
            lw.grouped_matmul_numel += t.numel * multiplied
            lw.int8_matmul_numel += t.numel * multiplied * (layout == INT8_LAYOUT)
    experts = tuple(t for t in layer.tensors if expert_of(t.key) is not None)
    if experts and len(experts) < len(layer.tensors):
        lw.experts = layer_weights(dataclasses.replace(layer, tensors=experts), placement, compression, dtype, device)
    return lw


def _matmuls(layer: LayerSpec, gbs: int, nb: int, tokens: int, phase: str) -> tuple[int, int]:
    """(activation rows, times) a layer's linears multiply per step: per GPU batch, except a
    decode step's transformer blocks, which multiply the whole block's rows at once, and its
    head, GPU batches merged up to working_set.MERGED_HEAD_ROWS rows a call
    (executor/schedule.py); the head projects only the last position."""
    if phase == "decode" and layer.kind == "block":
        return gbs * nb * tokens, 1
    if phase == "decode" and layer.kind == "head":
        return decode_head_work(gbs, nb)
    return gbs * (tokens if layer.kind != "head" else 1), nb


# ---- the model ----------------------------------------------------------------------------

class CostModel:
    """The cost of running `cfg` on this hardware for this workload, under any policy."""

    def __init__(self, cfg: ModelConfig, profile: HardwareProfile, workload: Workload,
                 dtype: torch.dtype | None = None, weight_grids: WeightGrids | None = None):
        """weight_grids: the weights' compression as a loaded engine resolved it for its source
        (search.SearchOptions.weight_grids), priced where a policy's compress_weight is its setting."""
        self.cfg, self.hw, self.work, self.weight_grids = cfg, profile, workload, weight_grids
        self.dtype = dtype or DTYPES[profile.dtype]
        self.elt = torch.empty((), dtype=self.dtype).element_size()
        self.layers = family_of(cfg).layer_specs(cfg)
        # identical layers (every transformer block of one sliding window) cost the same: model one
        # of each, times its count
        groups: dict[tuple, list[LayerSpec]] = {}
        for layer in self.layers:
            shapes = tuple((t.key, t.shape, t.store_name.split(".")[0]) for t in layer.tensors)
            groups.setdefault((layer.kind, self._window(layer), shapes), []).append(layer)
        self.groups = [(members[0], len(members)) for members in groups.values()]
        # each layer's group, in schedule order
        self._group_of = [next(g for g, members in enumerate(groups.values()) if layer in members)
                          for layer in self.layers]
        self.counts = [n for _, n in self.groups]
        self._weights_cache: dict = {}
        self._memo: dict = {}

    def _window(self, layer: LayerSpec) -> int:
        return self.cfg.window(layer.index) if layer.kind == "block" else 0

    def layer_terms(self, layer: LayerSpec, lw: LayerWeights, policy: Policy, fr: Fractions, phase: str
                    ) -> dict[str, float]:
        """One layer, one phase: seconds per term."""
        work, reads = self._layer_work(layer, lw, policy, fr, phase)
        return self._seconds(work, reads, policy, phase)

    def _layer_work(self, layer: LayerSpec, lw: LayerWeights, policy: Policy, fr: Fractions, phase: str
                    ) -> tuple[dict[str, float], float]:
        """Bytes per link and compute seconds of one layer in one phase, and how many separate
        disk reads it makes (each pays the disk's latency)."""
        cfg, hw, elt = self.cfg, self.hw, self.elt
        gbs, nb = policy.gpu_batch_size, policy.num_gpu_batches
        _, c, h = fr.splits()
        prefill = phase == "prefill"
        # new positions per sequence: a prefill's after the shared prefix, computed once a block
        shared = self.work.shared_prefix if policy.prefix_sharing else 0
        tokens = self.work.prompt_len - shared if prefill else 1
        cuda = hw.is_cuda
        b = {t: 0.0 for t in TERMS}  # bytes per link, seconds for compute
        dev = hw.compute

        # weights: once per step for the whole block; of a sparse MoE block's experts, those the
        # block's tokens are expected to choose (each row multiplies k of them)
        rows, calls = _matmuls(layer, gbs, nb, tokens, phase)
        # a block that keeps dense copies makes them in its prefill; where every weight is in the
        # compute tier's memory the load makes them for every block (ModelRuntime.dense_copies):
        # counted as none
        kept = (("decode" if policy.dense_copies_across_blocks else phase) if policy.keep_dense_weights else None)
        weights_compute = self._weights_compute(lw, rows, calls, kept)
        if lw.experts is not None:
            touched = expected_experts_touched(cfg.num_experts, cfg.experts_per_token, gbs * nb * tokens)
            weights_compute += self._experts_compute(lw.experts, rows, calls) - self._weights_compute(
                lw.experts, rows, calls)
            # one call a layer and step, the block's rows merged (models/moe.expert_mlp)
            weights_compute += touched * self._per_expert_s(phase)
            lw = lw.plus(lw.experts.scaled(touched / cfg.num_experts - 1.0))
        if kept != "decode":  # a block that keeps its weights loads each layer once, in its prefill
            b["disk_cpu"] += lw.stored["disk"]
            if cuda:
                b["cpu_gpu"] += lw.stored["cpu"] + lw.stored["disk"]
            else:
                b["cpu_gpu"] += lw.assembled

        if prefill and shared and layer.kind != "head":
            weights_compute += self._weights_compute(lw, *_matmuls(layer, 1, 1, shared, phase), kept)
        b["compute"] += weights_compute
        b["compute"] += (calls if layer.kind == "head" else nb) * self._fixed_per_layer_batch(layer, policy, phase)
        if layer.kind == "block":
            per_hidden, per_mlp = ELEMENTWISE_PASSES.get(cfg.family, ELEMENTWISE_PASSES["llama"])
            # a sparse MoE block's row goes through k experts (and the shared one)
            mlp_width = (cfg.experts_per_token * cfg.expert_ffn_size + cfg.shared_expert_ffn_size
                         if cfg.sparse_block(layer.index) else cfg.ffn_size)
            passes = per_hidden * cfg.hidden_size + per_mlp * mlp_width
            if cfg.qk_norm:
                passes += QK_NORM_PASSES * (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
            if cfg.sparse_block(layer.index):
                passes += cfg.experts_per_token * EXPERT_ROUTING_PASSES * cfg.hidden_size
            b["compute"] += nb * gbs * tokens * passes / dev.elementwise_elems_per_s

        # activations: stored after each layer but the head, loaded before each but the embedding
        hidden = gbs * tokens * cfg.hidden_size * elt
        stores, loads = nb * (layer.kind != "head"), nb * (layer.kind != "embed")
        if cuda:  # on a CPU-only machine the gpu and cpu tiers are the same memory: no move
            b["gpu_cpu"] += stores * hidden * (h["cpu"] + h["disk"])
            b["cpu_gpu"] += loads * hidden * (h["cpu"] + h["disk"])
        b["cpu_disk"] += stores * hidden * h["disk"]
        b["disk_cpu"] += loads * hidden * h["disk"]

        if layer.kind == "block":
            self._attention_and_cache(b, policy, c, gbs, nb, tokens, prefill, self._window(layer))
        # linear in the fractions, as the LP needs
        reads = lw.disk_reads + loads * h["disk"] + (nb * 2 * c["disk"] if layer.kind == "block" and not prefill else 0)
        return b, reads

    def kernel_takes(self, rows: int) -> bool:
        """Whether a packed 4-bit weight multiplies `rows` activation rows on the int4 kernel
        (CompressedWeight.linear, at the crossover this profile measured) rather than
        dequantized."""
        most = self.hw.compute.int4_kernel_max_rows(self.hw.dtype)
        return most is None or rows <= most

    def int8_kernel_takes(self, rows: int) -> bool:
        """Whether an 8-bit weight in the int8 kernel's layout multiplies `rows` activation rows
        on the int8 kernel (the profile's crossover, as the engine takes it: compression/int8.py)
        rather than dequantized."""
        most = self.hw.compute.int8_kernel_max_rows(self.hw.dtype)  # 0 where not measured
        return most is None or rows <= most

    def _weights_compute(self, lw: LayerWeights, rows: int, nb: int, kept: str | None = None) -> float:
        """Seconds of one layer's matmuls for nb GPU batches of `rows` activation rows, with
        compressed weights dequantized once per load (the copy the layer's GPU batches share)
        where the int4 kernel does not take them, and on the kernel, at its profiled speed for
        that row count, where it does. kept: the phase of a block that keeps its dense copies
        (Policy.keep_dense_weights): its prefill dequantizes every compressed weight, its decode
        steps multiply the copies the prefill made ("decode" for a prefill too where the load
        made them for every block)."""
        dev, dtype = self.hw.compute, self.hw.dtype
        dense = lw.matmul_numel - lw.packed_matmul_numel
        # 8-bit weights the int8 kernel takes at these rows: multiplied on their codes, not dequantized
        int8 = lw.int8_matmul_numel if kept is None and self.int8_kernel_takes(rows) else 0
        seconds = 0.0 if kept == "decode" else (lw.grouped_numel - int8) / dev.dequant_elems_per_s
        if int8:
            seconds += nb * 2 * rows * int8 / dev.int8_flops(rows)
            dense -= int8
        if lw.row_lookup_width:  # one table row per looked-up position
            seconds += nb * rows * lw.row_lookup_width / dev.int4_dequant_elems_per_s
        seconds += nb * rows * lw.grouped_lookup_width / dev.dequant_elems_per_s
        if kept == "decode":
            dense = lw.matmul_numel
            # where the profile measured a kernel faster than the held copy at these rows, the
            # engine multiplies on the codes (compression/int4.KERNEL_OVER_KEPT_ROWS)
            for kernel, numel in (("int4", lw.packed_matmul_numel), ("int8", lw.int8_matmul_numel)):
                gain = dev.kernel_over_kept_gain(kernel, rows)
                if numel and gain > 1.0:
                    seconds += nb * 2 * rows * numel / (dev.linear_flops(dtype, rows) * gain)
                    dense -= numel
        elif lw.packed_numel and kept is None and self.kernel_takes(rows):
            seconds += nb * 2 * rows * lw.packed_matmul_numel / dev.int4_flops(rows)
            seconds += (lw.packed_numel - lw.packed_matmul_numel) / dev.int4_dequant_elems_per_s  # lookups
        elif lw.packed_numel:
            seconds += lw.packed_numel / dev.int4_dequant_elems_per_s
            dense += lw.packed_matmul_numel
        return seconds + nb * 2 * rows * dense / dev.linear_flops(dtype, rows)

    def _experts_compute(self, experts: LayerWeights, rows: int, nb: int) -> float:
        """_weights_compute of a sparse block's experts: per call, the experts its `rows` are
        expected to choose (loaded, dequantized), each multiplying its share of the rows' k
        choices."""
        touched = expected_experts_touched(self.cfg.num_experts, self.cfg.experts_per_token, rows)
        return self._weights_compute(experts.scaled(touched / self.cfg.num_experts),
                                     rows * self.cfg.experts_per_token / touched, nb)

    def dequantized_numel(self, lw: LayerWeights, rows: int, expert_rows: int | None = None) -> int:
        """Elements of the dense copy a loaded layer makes of its compressed weights for
        `rows` activation rows (held while the layer computes). A sparse MoE block's experts
        make theirs one expert at a time, each dropped once its rows are done
        (models/moe.expert_mlp, executor/expert_weights.py): the block holds its other
        weights' copy and one expert's. `expert_rows`: the rows of the experts' call (the
        block's, gathered), of which an expert takes at most all: where the kernel takes
        them it takes every expert's."""
        if lw.experts is None:
            return self._dense_numel(lw, rows)
        one_expert = lw.experts.scaled(1.0 / self.cfg.num_experts)
        return (self._dense_numel(lw.plus(lw.experts.scaled(-1.0)), rows)
                + self._dense_numel(one_expert, rows if expert_rows is None else expert_rows))

    def _dense_numel(self, lw: LayerWeights, rows: int) -> int:
        return round(lw.grouped_numel + lw.packed_numel - (lw.packed_matmul_numel if self.kernel_takes(rows) else 0)
                     - (lw.int8_matmul_numel if self.int8_kernel_takes(rows) else 0))

    def _fixed_per_layer_batch(self, layer: LayerSpec, policy: Policy, phase: str) -> float:
        """What one layer costs one GPU batch besides its arithmetic and data: the profiled fixed
        cost (planner/overhead_profile.py), plus the copy thread's hand-offs when the schedule
        runs transfers on it (executor/transfer_ways.py: with anything on disk, or on a GPU
        where its copies do not go on streams). A hand-made profile without fixed costs counts
        the layer's ops at the tiny-op latency."""
        dev = self.hw.compute
        fixed = dev.fixed_costs.get(self.cfg.family, {}).get(phase)
        if fixed is None:
            return (OPS_PER_BLOCK if layer.kind == "block" else OPS_PER_OTHER_LAYER) * dev.op_latency_s
        threaded = transfers_on_threads(policy, self.cfg, self.hw.is_cuda)
        return fixed["per_layer_batch"] + (TRANSFERS_PER_LAYER_BATCH * dev.copy_handoff_s if threaded else 0.0)

    def _per_expert_s(self, phase: str) -> float:
        """What each expert an MoE block's call touches costs besides its arithmetic: the
        profiled per_expert, or EXPERT_CALL_OPS at the tiny-op latency."""
        fixed = self.hw.compute.fixed_costs.get(self.cfg.family, {}).get(phase, {})
        return fixed.get("per_expert", EXPERT_CALL_OPS * self.hw.compute.op_latency_s)

    def step_overhead_s(self, phase: str) -> float:
        """The profiled fixed cost of one token step of the block (sampling, bookkeeping)."""
        return self.hw.compute.fixed_costs.get(self.cfg.family, {}).get(phase, {}).get("per_step", 0.0)

    def _seconds(self, b: dict[str, float], reads: float, policy: Policy, phase: str) -> dict[str, float]:
        """Bytes per link -> seconds at the profiled rates, with the CPU-only machine's copies
        taking turns with compute, and the refit's scale of each term."""
        hw, cuda = self.hw, self.hw.is_cuda
        mem = hw.memcpy_bytes_per_s
        h2d = (hw.h2d_pinned_bytes_per_s if policy.pin_weight else hw.h2d_pageable_bytes_per_s) if cuda else mem
        d2h = hw.d2h_pinned_bytes_per_s if cuda else mem
        out = {
            "cpu_gpu": b["cpu_gpu"] / h2d,
            "gpu_cpu": b["gpu_cpu"] / d2h,
            "disk_cpu": b["disk_cpu"] / hw.disk_read_bytes_per_s + reads * hw.disk_read_latency_s,
            "cpu_disk": b["cpu_disk"] / hw.disk_write_bytes_per_s,
            "compute": b["compute"],
        }
        if not cuda:
            # Without a GPU the copies are memcpys run by the same cores that compute: they
            # take turns with it, not overlap (disk transfers are DMA and do overlap).
            out["compute"] += out["cpu_gpu"] + out["gpu_cpu"]
            out["cpu_gpu"] = out["gpu_cpu"] = 0.0
            if policy.overlap:
                self._share_cores_with_disk(out, phase)
        return {t: v * hw.time_scale.get(f"{phase}.{t}", 1.0) for t, v in out.items()}

    def _share_cores_with_disk(self, out: dict[str, float], phase: str) -> None:
        """Disk transfers and compute on the same few cores (CPU-only): when both run, the
        profiled fraction `loss` of the shorter does not hide behind the longer. With c the
        compute and d the disk time, max(c + loss * d, d + loss * c) is that (up to rounding),
        and each side stays affine in the placement fractions, as the LP needs."""
        loss = self.hw.disk_overlap_loss.get(phase, 0.0)
        compute, disk = out["compute"], out["disk_cpu"] + out["cpu_disk"]
        out["compute"] += loss * disk
        # unconditionally (a guard on disk traffic would break affinity): with none, a disk
        # term is loss * compute <= compute and never the max
        out["disk_cpu"] += loss * compute
        out["cpu_disk"] += loss * compute

    def _attention_and_cache(self, b: dict, policy: Policy, c: dict, gbs: int, nb: int, tokens: int,
                             prefill: bool, window: int = 0) -> None:
        """KV-cache traffic and attention compute of one block layer, added into `b`; a
        sliding-window block reads and attends to at most its window."""
        cfg, hw = self.cfg, self.hw
        cuda, dev, cpu = hw.is_cuda, hw.compute, hw.cpu
        units = gbs * cfg.num_kv_heads
        # K and V of one position of one GPU batch: as stored (maybe compressed), and as attended
        stored = kv_nbytes_per_position(units, cfg.head_dim, self.dtype, policy.cache_storage)
        dense = 2 * units * cfg.head_dim * self.elt
        delegated = policy.cpu_cache_compute

        # store the new positions' K, V into the slots of every tier (quantized first if compressed,
        # at about the speed of dequantizing; rounded, where the values are held dense: about twice)
        new = nb * tokens * stored
        b["gpu_cpu"] += new * (c["cpu"] + c["disk"] + (0.0 if cuda else c["gpu"]))
        b["cpu_disk"] += new * c["disk"]
        if policy.compress_cache is not None:
            b["compute"] += ((1 + policy.keep_dense_cache) * nb * tokens * dense / self.elt
                             / dev.dequant_elems_per_s)

        if prefill:  # attention over the prompt, on the compute device (the full s x s is computed,
            # a sliding window's too: it is a mask over the same scores)
            s = self.work.prompt_len
            b["compute"] += nb * 4 * gbs * cfg.num_heads * tokens * s * cfg.head_dim / dev.attn_prefill_flops
            return

        # decode: read the cache of the mean length, a window's at most (V shrinks under sparse
        # attention, the paper's top-k: only the kept values need to move)
        # (a ring's rows: a KIVI cache held dense keeps at least a group's, kv_cache.cache_rows)
        t = min(self.work.mean_decode_len, max(window, rounded_group_rows(policy))) if window \
            else self.work.mean_decode_len
        held_out = held_out_prefix(self.work.shared_prefix, window, policy)
        if held_out:
            # the shared prefix (under KIVI its complete groups) is not read per sequence: its
            # one copy, on the compute device, meets the block's queries in one matmul per
            # key-value head (attend_past_shared_prefix, attend_past_held_prefix), a compressed
            # one dequantized once a step
            held = held_out[1]
            t -= held
            scores = nb * gbs * cfg.num_heads * held
            b["compute"] += (scores * 4 * cfg.head_dim / dev.attn_prefill_flops
                             + scores * PREFIX_SCORE_BYTES / dev.attn_decode_bytes_per_s)
            if policy.cache_dequantized_per_step:  # (held dense: stored rounded, never dequantized)
                b["compute"] += 2 * held * cfg.num_kv_heads * cfg.head_dim / dev.dequant_elems_per_s
        read = nb * t * stored / 2 * (1 + policy.attn_sparsity)
        b["disk_cpu"] += read * c["disk"]
        if not cuda and not policy.cache_dequantized_per_step and window:
            # a sliding window's ring, read off disk, is copied into the buffers attention reads;
            # any other dense part read off disk is attended where the read put it, as a memory
            # tier's in place (KVCacheSlot.reads_in_place), and a compressed one is dequantized
            # into them, priced below
            b["compute"] += read * c["disk"] / hw.memcpy_bytes_per_s
        if cuda and not delegated:
            b["cpu_gpu"] += read * (c["cpu"] + c["disk"])
        if cuda and delegated:  # q over, attention output back
            qo = nb * gbs * cfg.num_heads * cfg.head_dim * self.elt * (c["cpu"] + c["disk"])
            b["cpu_gpu"] += qo
            b["gpu_cpu"] += qo
        attended = nb * t * dense
        on_cpu = c["cpu"] + c["disk"] if delegated else 0.0
        b["compute"] += attended * ((1 - on_cpu) / dev.attn_decode_bytes_per_s + on_cpu / cpu.attn_decode_bytes_per_s)
        if policy.cache_dequantized_per_step:
            b["compute"] += attended / self.elt / dev.dequant_elems_per_s

    # ---- whole model -------------------------------------------------------------------

    def weight_compression(self, policy: Policy) -> WeightCompression:
        """How the policy's weights are stored, as far as known: its compress_weight resolved for
        the model's source (a GGUF's own codes keep each tensor's format: the bundled SmolLM2's
        Q8_0 table beside its Q4_1 blocks) where the engine resolved it, else the setting, which
        stands for every weight (compression/grids.tensor_compression)."""
        grids = self.weight_grids
        return grids if grids is not None and grids.setting == policy.compress_weight else policy.compress_weight

    def weights_per_layer(self, policy: Policy) -> list[LayerWeights]:
        key = (policy.weights, policy.compress_weight)
        if key not in self._weights_cache:  # the search asks for the same weight placement many times
            compression = self.weight_compression(policy)
            placement = place_weights(self.layers, policy.weights, compression)
            device = torch.device(self.hw.compute_device)
            lws = [layer_weights(layer, placement, compression, self.dtype, device)
                   for layer, _ in self.groups]
            if any(lw.packed_numel or lw.row_lookup_width for lw in lws) and not (self.hw.compute.int4_matmul_flops
                                                          and self.hw.compute.int4_dequant_elems_per_s):
                raise ProfileFormatError(
                    f"4-bit weights would compute on the int4 kernel of {device.type}, but the hardware profile has "
                    "no speeds of it (int4_matmul_flops, int4_dequant_elems_per_s): measure this machine with "
                    "`flexgen-helm profile`")
            self._weights_cache[key] = lws
        return self._weights_cache[key]

    def phase_terms(self, policy: Policy, phase: str) -> list[dict[str, float]]:
        """Per group of identical layers (see self.counts), seconds per term of one of its layers
        (the LP takes the max per layer with an epigraph variable)."""
        key = ("terms", policy, phase)
        if key not in self._memo:  # the search evaluates the same vertex policies many times
            fr = Fractions.of(policy)
            self._memo[key] = [self.layer_terms(layer, lw, policy, fr, phase)
                               for (layer, _), lw in zip(self.groups, self.weights_per_layer(policy))]
        return self._memo[key]

    def peak_bytes(self, policy: Policy) -> dict[str, dict[str, float]]:
        key = ("peak", policy)
        if key not in self._memo:
            self._memo[key] = self._peak_bytes(policy)
        return self._memo[key]

    def _peak_bytes(self, policy: Policy) -> dict[str, dict[str, float]]:
        """phase -> tier -> bytes: weight homes + KV cache + activations (as the engine accounts
        them, memory/budget.planned_components) + the compute side's working set: two layers of
        loaded weights (the one in use and the one prefetched), the dense copy of a compressed
        layer where the int4 kernel does not take its rows, two decode loads of a layer's K and V
        off the cpu/disk tiers (a GPU batch's, or a merged step's group of batches'), a held shared
        prefix dequantized where attention runs, the K and V of a GPU batch on its way to disk,
        one GPU batch's intermediate activations and attention mask, the head's logits, and the
        freed memory the schedule keeps resident for reuse. Measured against process RSS with
        runs/bench/memory/rss_phases.py."""
        cfg, elt, work = self.cfg, self.elt, self.work
        gbs, nb = policy.gpu_batch_size, policy.num_gpu_batches
        lws = self.weights_per_layer(policy)
        # a block that keeps its weights holds every layer's load (copies where a load makes one)
        loaded_weights = (sum(n * sum(lw.loaded.values()) for n, lw in zip(self.counts, lws))
                          if policy.keep_dense_weights else self._most_loaded_at_once(lws))
        _, c, _ = Fractions.of(policy).splits()
        moved = c["disk"] + (c["cpu"] if self.hw.is_cuda and not policy.cpu_cache_compute else 0.0)
        # a GPU batch's KV cache of one layer read off its tier (the longest a slot holds: a
        # global block's) by a decode step, as read and unpacked where attention reads it; a
        # load is one batch's, or a group of batches' where a step merges them (nb > 1,
        # executor/cache_buffers.load_group). Alive at once: the sets of unpacked buffers
        # (two on a GPU, whose copy lane unpacks the next load while one is in use; one on a
        # CPU, whose compute thread unpacks), and as read, the next load (on a CPU also the
        # one in use until it is unpacked, after the next one's reads went out). A dense disk
        # part that attention reads on the CPU is not unpacked: it is read with its new token's
        # row (KVCacheSlot.reads_in_place), unless some layer's is a sliding window's ring.
        on_cpu = not self.hw.is_cuda or policy.cpu_cache_compute
        disk_in_place = on_cpu and policy.cache_storage is None and not any(self._window(layer)
                                                                               for layer, _ in self.groups)
        unpacked_part = moved - (c["disk"] if disk_in_place else 0.0)
        held = max(cache_rows(work.max_len, self._window(layer),
                              held_out_prefix(work.shared_prefix, self._window(layer), policy),
                              rounded_group_rows(policy))
                   for layer, _ in self.groups)
        units = gbs * cfg.num_kv_heads
        as_read = kv_nbytes(held, units, cfg.head_dim, self.dtype, policy.cache_storage) * moved
        unpacked = kv_nbytes(held, units, cfg.head_dim, decode_cache_dtype(self.hw.compute_device, self.dtype),
                             None) * unpacked_part
        _, loaded_cache = load_group(as_read, unpacked, nb, unpacks_on_lane(self.hw.is_cuda))
        # a held prefix read as stored is unpacked once a layer where attention runs (the longest, a global block's)
        held_prefix = max((held_out_prefix(work.shared_prefix, self._window(layer), policy) or (0, 0))[1]
                          for layer, _ in self.groups)
        if held_prefix and reads_prefix_as_stored(policy):
            loaded_cache += unpacked_nbytes(held_prefix, cfg.num_kv_heads, cfg.head_dim, self.dtype,
                                            decode_cache_dtype(self.hw.compute_device, self.dtype),
                                            policy.cache_storage)
        # freed memory the schedule keeps resident for reuse (executor/working_set.py): a block
        # layer's dense copy of its compressed weights among it, and the largest layer's load
        # buffers, which are host memory (on a GPU, the cpu tier's)
        load_buffers = max(sum(lw.loaded.values()) for lw in lws)
        host = "cpu" if self.hw.is_cuda else "gpu"
        kept = kept_freed_bytes(cfg, gbs, work.prompt_len, self.dtype,
                                dense_weight_numel([layer for layer, _ in self.groups], policy.compress_weight),
                                head_rows=decode_head_rows(gbs, nb))  # the schedule's default
        kept_dense = self.kept_dense_bytes(policy)
        out = {}
        for phase in PHASES:
            tokens = work.prompt_len if phase == "prefill" else 1
            keys = work.prompt_len if phase == "prefill" else work.max_len
            placed = planned_components(cfg, policy, work.max_len, self.dtype, act_len=tokens,
                                        shared_prefix=work.shared_prefix, gpu_compute=self.hw.is_cuda,
                                        weight_compression=self.weight_compression(policy))
            # a decode step's blocks run the block's rows together, and so do a prefill's MoE blocks
            together = phase == "decode" or cfg.is_moe
            inner = batch_working_bytes(cfg, (gbs * nb if together else gbs) * tokens, self.dtype)
            scores = gbs * cfg.num_heads * tokens * keys * ATTENTION_MASK_BYTES
            logits = gbs * nb * cfg.vocab_size * 4  # fp32, the last position of every sequence
            # a GPU batch's new K and V on their way to the disk tier: two copies each (its
            # positions made contiguous, then its rows' bytes)
            storing = 2 * 2 * gbs * tokens * cfg.num_kv_heads * cfg.head_dim * elt * c["disk"]
            tiers = {t: float(sum(part[t] for part in placed.values())) for t in TIERS}
            # the dense copy of a compressed layer's weights, made where it computes (only the one in use)
            dequantized = max(self.dequantized_numel(lw, _matmuls(layer, gbs, nb, tokens, phase)[0],
                                                     expert_rows=gbs * nb * tokens)
                              for (layer, _), lw in zip(self.groups, lws)) * elt
            if policy.keep_dense_weights:  # the one in use is one of the kept copies
                dequantized = kept_dense
            tiers["gpu"] += (loaded_weights + dequantized + inner + kept + scores + logits + storing
                             + (loaded_cache if phase == "decode" else 0.0))
            tiers[host] += load_buffers
            out[phase] = tiers
        return out

    def _most_loaded_at_once(self, lws: list[LayerWeights]) -> float:
        """Weight bytes loaded off their homes at once: a layer in use and the next one
        prefetched (after the head, the next step's first layer), a weight they share (the tied
        head and embedding) loaded once for both (executor/schedule.py). A sparse MoE block is
        prefetched without its experts, which load as its router picks them
        (executor/expert_weights.py)."""
        most = 0.0
        for i, layer in enumerate(self.layers):
            j = (i + 1) % len(self.layers)
            here, ahead = lws[self._group_of[i]], lws[self._group_of[j]]
            mine = {t.store_name for t in layer.tensors}
            shared = sum(ahead.loaded[t.key] for t in self.layers[j].tensors if t.store_name in mine)
            most = max(most, self._loaded_in_use(here) + sum(ahead.loaded.values()) - shared
                       - (sum(ahead.experts.loaded.values()) if ahead.experts is not None else 0.0))
        return most

    def _loaded_in_use(self, lw: LayerWeights) -> float:
        """Bytes a layer in use holds loaded: a sparse MoE block's experts one in use and
        EXPERTS_IN_FLIGHT on their way at most, each released once its rows are done."""
        if lw.experts is None:
            return sum(lw.loaded.values())
        experts = sum(lw.experts.loaded.values())
        held = min(self.cfg.num_experts, EXPERTS_IN_FLIGHT + 1) / self.cfg.num_experts
        return sum(lw.loaded.values()) - experts + held * experts

    def accounted_bytes(self, policy: Policy) -> dict[str, int]:
        """Peak of what the engine's TierUsage records: weight homes on the gpu and cpu tiers (disk
        weights stay in the weight store, which it does not count), the KV cache, one prefill
        hidden state per GPU batch, and the dense copies a block keeps (kept_dense_bytes)."""
        comps = planned_components(self.cfg, policy, self.work.max_len, self.dtype, act_len=self.work.prompt_len,
                                   shared_prefix=self.work.shared_prefix, gpu_compute=self.hw.is_cuda,
                                   weight_compression=self.weight_compression(policy))
        comps["weights"]["disk"] = 0
        out = {t: sum(comps[k][t] for k in comps) for t in TIERS}
        out["gpu"] += self.kept_dense_bytes(policy)
        return out

    def kept_dense_bytes(self, policy: Policy) -> int:
        """The dense copies a block keeps (Policy.keep_dense_weights; executor/kept_weights.py):
        one of every compressed weight it multiplies, and of every compressed table that
        dequantizes whole to look rows up (those whose rows decode apart make none)."""
        if not policy.keep_dense_weights:
            return 0
        lws = self.weights_per_layer(policy)
        return round(sum(n * (lw.packed_numel + lw.grouped_numel) for n, lw in zip(self.counts, lws)) * self.elt)

    def estimate(self, policy: Policy) -> Estimate:
        phase_s, terms, bottleneck = {}, {}, {}
        for phase in PHASES:
            per_layer = self.phase_terms(policy, phase)
            combine = max if policy.overlap else sum
            phase_s[phase] = (sum(n * combine(lt.values()) for n, lt in zip(self.counts, per_layer))
                              + self.step_overhead_s(phase))
            terms[phase] = {t: sum(n * lt[t] for n, lt in zip(self.counts, per_layer)) for t in TERMS}
            dominant = {t: 0.0 for t in TERMS}  # time of the layers each term is the max of
            for n, lt in zip(self.counts, per_layer):
                top = max(reversed(TERMS), key=lt.get)  # a tie (disk_overlap_loss 1, no disk) is compute
                dominant[top] += n * lt[top]
            bottleneck[phase] = max(dominant, key=dominant.get)
        n = self.work.gen_len
        total = phase_s["prefill"] + (n - 1) * phase_s["decode"]
        return Estimate(
            prefill_terms=terms["prefill"], decode_terms=terms["decode"],
            prefill_s=phase_s["prefill"], decode_step_s=phase_s["decode"], total_s=total,
            throughput=policy.block_size * n / total if total > 0 else math.inf,
            block_size=policy.block_size,
            peak_bytes={ph: {t: int(v) for t, v in tiers.items()} for ph, tiers in self.peak_bytes(policy).items()},
            accounted_bytes=self.accounted_bytes(policy),
            bottleneck=bottleneck,
        )


def estimate(cfg: ModelConfig, policy: Policy, profile: HardwareProfile, prompt_len: int, gen_len: int,
             dtype: torch.dtype | None = None) -> Estimate:
    return CostModel(cfg, profile, Workload(prompt_len, gen_len), dtype).estimate(policy)

