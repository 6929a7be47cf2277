"""Group-wise asymmetric min/max quantization (FlexGen Section 5): pack, unpack, and
compressed tensors that can live on any tier."""

from flexgen_helm.compression.matmul import dequantize_linear
from flexgen_helm.compression.quantize import (
    CACHE_GROUP_DIM,
    WEIGHT_GROUP_DIM,
    QuantizedTensor,
    cache_group_dim,
    codes_of,
    default_cache_group_dim,
    default_weight_group_dim,
    dequantize,
    fake_quantize,
    pack,
    quantize,
    should_compress,
    unpack,
    weight_group_dim,
)

__all__ = [
    "CACHE_GROUP_DIM",
    "WEIGHT_GROUP_DIM",
    "QuantizedTensor",
    "cache_group_dim",
    "codes_of",
    "default_cache_group_dim",
    "default_weight_group_dim",
    "dequantize",
    "dequantize_linear",
    "fake_quantize",
    "pack",
    "quantize",
    "should_compress",
    "unpack",
    "weight_group_dim",
]
