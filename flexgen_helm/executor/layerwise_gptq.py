"""GPTQ over a whole model, one layer at a time, on the CPU (the weights' calibration at
conversion: weights/compressed_store.WeightCalibration).

The calibration inputs flow through the model in the CPU's compute dtype (bfloat16 where the
CPU has bf16 arithmetic: a quarter of float32's time on such a CPU, and the dtype the model
then runs in); each input Hessian is accumulated and every GPTQ step runs in float32, so a
bfloat16 input enters exactly (its products are exact in float32).

The calibration sequences (executor/calibration_text.py) go through the model once, all
together, as one prefill without a cache. A block's inputs are the outputs of the blocks
before it *as quantized*, and inside a block every weight is quantized at its first
product (q, k and v, or gate and up, share the inputs' Hessian), so each one is fitted to
the inputs the quantized model will give it, and the block's outputs are computed with the
quantized weights and passed on ("true sequential" GPTQ).

The head is quantized the same way, against the last hidden states it multiplies; where
the embedding is tied to it (SmolLM2), the lookup takes the head's codes. An untied
embedding is only looked up, so GPTQ has no inputs to weigh its error by: it takes the
data-free fit (method DATA_FREE_METHOD), in the same codes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from flexgen_helm.compression.gptq import (
    DAMP,
    LAZY_COLUMNS,
    MAX_COLUMN_BLOCK,
    column_blocks,
    gptq_quantize,
    input_factors,
)
from flexgen_helm.compression.quantize import QuantizedTensor, dequantize, quantize
from flexgen_helm.compression.stored import weight_groups
from flexgen_helm.executor.attention import attend, from_units, to_units
from flexgen_helm.executor.calibration_text import CalibrationText
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.spec import LayerSpec
from flexgen_helm.policy.policy import Compression

DATA_FREE_METHOD = "hqq"  # for an embedding not tied to the head (module doc)
CPU = torch.device("cpu")


@dataclass
class LayerwiseGPTQ:
    """A WeightCalibration: samples the calibration text with `sample` (the engine's
    generate on the unquantized model), then quantizes every compressed weight."""

    config: ModelConfig
    family: ModuleType
    compression: Compression
    sample: Callable[[CalibrationText], list[list[int]]]
    compute_dtype: torch.dtype  # of the pass's products (module doc); the sampler's too
    text: CalibrationText = field(default_factory=CalibrationText)
    progress: bool = True
    timings: dict = field(default_factory=dict)  # of the last call: its steps' wall and CPU seconds

    @property
    def settings(self) -> dict:
        return {"text": self.text.settings(), "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "damp": DAMP, "lazy_columns": LAZY_COLUMNS,
                "max_column_block": MAX_COLUMN_BLOCK, "untied_embedding": DATA_FREE_METHOD}

    def __call__(self, read_full: Callable[[str], torch.Tensor], dtype: torch.dtype) -> dict[str, QuantizedTensor]:
        t0, cpu0 = time.perf_counter(), time.process_time()
        ids = torch.tensor(self.sample(self.text), dtype=torch.long)
        t1, cpu1 = time.perf_counter(), time.process_time()
        out = quantize_layer_by_layer(self.config, self.family, self.compression, read_full, ids, dtype,
                                      self.compute_dtype, self.progress)
        self.timings = {"calibration_tokens": ids.numel(), "sample_s": t1 - t0, "sample_cpu_s": cpu1 - cpu0,
                        "quantize_s": time.perf_counter() - t1, "quantize_cpu_s": time.process_time() - cpu1}
        return out


def quantize_layer_by_layer(cfg: ModelConfig, family: ModuleType, compression: Compression,
                            read_full: Callable[[str], torch.Tensor], ids: torch.Tensor, dtype: torch.dtype,
                            compute: torch.dtype, progress: bool = False) -> dict[str, QuantizedTensor]:
    """Every compressed weight of the model, quantized (module doc) on the calibration token
    ids (sequences, length), their products in `compute`; scales and minimums in `dtype`."""
    n, length = ids.shape
    positions = torch.arange(length).expand(n, length)
    at = family.step_constants(family.run_constants(cfg, length, CPU, compute), positions)
    valid = torch.ones(n * cfg.num_kv_heads, length, dtype=torch.bool)
    data_free = dataclasses.replace(compression, method=DATA_FREE_METHOD)
    layers = family.layer_specs(cfg)
    in_head = {t.store_name for layer in layers if layer.kind == "head" for t in layer.tensors}
    out: dict[str, QuantizedTensor] = {}
    h = None
    for layer in tqdm(layers, desc=f"GPTQ ({n} x {length} calibration tokens)", unit="layer", disable=not progress):
        if layer.kind in ("block", "head"):
            h = _quantize_layer(cfg, family, layer, compression, read_full, h, at, valid, dtype, compute, out)
            continue
        w = {}
        for t in layer.tensors:
            gd = weight_groups(compression, t.shape)
            if gd is None or t.store_name in in_head:  # plain, or quantized by the head it is tied to
                w[t.key] = read_full(t.store_name).to(compute)
                continue
            if t.store_name not in out:
                out[t.store_name] = quantize(read_full(t.store_name).to(dtype), data_free, gd)
            w[t.key] = dequantize(out[t.store_name], compute)
        if layer.kind == "embed":
            h = family.embed(cfg, w, ids, positions)
    return out


def _quantize_layer(cfg: ModelConfig, family: ModuleType, layer: LayerSpec, compression: Compression,
                    read_full, h: torch.Tensor, at, valid: torch.Tensor, dtype: torch.dtype, compute: torch.dtype,
                    out: dict[str, QuantizedTensor]) -> torch.Tensor | None:
    """Quantize a block's (or the head's) weights into `out`; returns the block's output on
    `h`, as quantized (the head's: None)."""
    shared = _SharedInputs()
    w, calibrated = {}, {}
    for t in layer.tensors:
        full = read_full(t.store_name)
        gd = weight_groups(compression, t.shape)
        w[t.key] = full.to(compute) if gd is None else _CalibratedLinear(full.float(), shared, compression, gd, dtype,
                                                                        compute)
        if gd is not None:
            calibrated[t.store_name] = w[t.key]
    if layer.kind == "head":
        family.head(cfg, w, h)
        h = None
    else:
        q, key, value = family.qkv(cfg, w, h, at, layer.index)
        b, kvh, s, d = key.shape
        attn = attend(to_units(q, kvh), key.reshape(b * kvh, s, d), value.reshape(b * kvh, s, d), valid,
                      causal=True, window=cfg.window(layer.index), softcap=cfg.attn_softcap)
        h = family.finish_block(cfg, w, h, from_units(attn, b))
    for name, linear in calibrated.items():
        if linear.quantized is None:
            raise ValueError(f"{name} is compressed but the {layer.kind}'s math never multiplied it: GPTQ has no "
                             "inputs to quantize it against")
        out[name] = linear.quantized
    return h


class _SharedInputs:
    """The factors of the last input seen: q, k and v (gate and up) multiply the same tensor."""

    def __init__(self):
        self._x: torch.Tensor | None = None
        self._factors: list[torch.Tensor] = []

    def factors(self, x: torch.Tensor, blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
        if x is not self._x:
            self._x, self._factors = x, input_factors(x, blocks)
        return self._factors


class _CalibratedLinear:
    """A block's weight during the pass: not a tensor, so models/linear.py hands it its
    products. The first quantizes it by GPTQ against that product's inputs; every product
    computes with the quantized weight."""

    def __init__(self, weight: torch.Tensor, shared: _SharedInputs, cfg: Compression, group_dim: int,
                 dtype: torch.dtype, compute: torch.dtype):
        self.weight = weight  # float32 until quantized, then its dequantized codes in `compute`
        self.compute = compute
        self.shared = shared
        self.cfg = cfg
        self.group_dim = group_dim
        self.dtype = dtype
        self.quantized: QuantizedTensor | None = None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quantized is None:
            blocks = column_blocks(x.shape[-1], self.cfg.group_size, self.group_dim)
            self.quantized = gptq_quantize(self.weight, self.shared.factors(x, blocks), blocks, self.cfg,
                                           self.group_dim, self.dtype)
            self.weight = dequantize(self.quantized, self.compute)
        return F.linear(x, self.weight, bias)
