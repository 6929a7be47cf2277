"""Group-wise asymmetric min/max quantization (FlexGen Section 5): pack, unpack,
compressed tensors that can live on any tier, and 4-bit weights in torch's int4 kernel
layouts with the matmul that uses them."""

from flexgen_helm.compression.int4 import CompressedWeight, PackedInt4, dequantize_packed, pack_int4
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
    "CompressedWeight",
    "PackedInt4",
    "dequantize_packed",
    "pack_int4",
    "fake_quantize",
    "pack",
    "quantize",
    "should_compress",
    "unpack",
    "weight_group_dim",
]
