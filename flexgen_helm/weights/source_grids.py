"""Which weights keep their source's own codes under a SOURCE_CODE_METHODS compression
(compression/grids.py), decided once per model from the GGUF's tensor types, before any
weight is read; the rest are re-quantized onto the setting's grid, and a log line says so."""

from __future__ import annotations

import logging
from collections import defaultdict

from flexgen_helm.compression.grids import SOURCE_GROUP_SIZE, WeightCompression, WeightGrids, takes_source_codes
from flexgen_helm.compression.quantize import should_compress
from flexgen_helm.errors import PolicyError
from flexgen_helm.models.spec import TensorSpec
from flexgen_helm.weights.gguf_codes import code_bits, codes_fit, held_types
from flexgen_helm.weights.gguf_file import GGUFFile
from flexgen_helm.weights.source import WeightSource

logger = logging.getLogger(__name__)


def weight_grids(cfg: WeightCompression, source: WeightSource, specs: list[TensorSpec],
                 say: bool = True) -> WeightCompression:
    """`cfg` as it is, or, for a SOURCE_CODE_METHODS setting, resolved for `source`'s tensors
    (once: a resolved one is returned as it is), in a log line (say: the engine's load; the
    planner, pricing the same weights before it, says nothing)."""
    if isinstance(cfg, WeightGrids) or not takes_source_codes(cfg):
        return cfg
    if not isinstance(source, GGUFFile):
        raise PolicyError(f"compress_weight: method {cfg.method} takes a GGUF file's own codes; "
                          f"{source.config.name} is not read from a GGUF file (its weights are floats): "
                          "quantize them with rtn, hqq or gptq")
    kept, requantized = [], defaultdict(list)
    for spec in specs:
        if not should_compress(spec.shape):
            continue
        kind = source.tensor_type(spec.store_name)
        bits = code_bits(kind)
        if bits is not None and codes_fit(kind, spec.shape):
            kept.append((spec.store_name, bits, kind))
        else:
            requantized[kind].append(spec.store_name)
    grids = WeightGrids(cfg, tuple((name, bits) for name, bits, _ in kept))
    if not say:
        return grids
    by_type = defaultdict(int)
    for _, bits, kind in kept:
        by_type[(kind, bits)] += 1
    logger.info("compressed weights: the GGUF's own codes, scales and minimums, as they are: %s",
                ", ".join(f"{kind} -> {bits}-bit groups of {SOURCE_GROUP_SIZE} ({n} tensors)"
                          for (kind, bits), n in sorted(by_type.items())) or "none")
    for kind, names in sorted(requantized.items()):
        logger.warning("compressed weights: %d GGUF %s tensor(s) (%s) hold no codes that can be kept "
                       "(held: %s, whole blocks along the input dim); re-quantized by min/max onto %d-bit groups "
                       "of %d instead", len(names), kind, names[0], ", ".join(held_types()), cfg.bits,
                       cfg.group_size)
    return grids
