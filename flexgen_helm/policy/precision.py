"""A policy's numerics in the paper's words (Table 5: FP16, 8-bit, 4-bit, 4-bit-S): what
leaderboards and accuracy tables call a setting. Placement and batching never change the
numbers, so they are not part of the name; the compute dtype, compression and sparse
attention are."""

from __future__ import annotations

from flexgen_helm.policy.policy import PER_CHANNEL, Policy

DTYPE_LABELS = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}


def setting_name(policy: Policy | dict, dtype: str) -> str:
    """"BF16" (uncompressed: the compute dtype), "8-bit", "8-bit per-channel" (weights in one group
    per output channel), "4-bit", "4-bit-S" (weights and KV
    cache compressed alike; -S: sparse attention), "4-bit weights", "8-bit cache", ...; a
    quantizer other than FlexGen's min/max round-to-nearest is named ("4-bit hqq")."""
    p = policy.to_dict() if isinstance(policy, Policy) else policy
    w, c = p.get("compress_weight"), p.get("compress_cache")
    sparse = p.get("attn_sparsity", 1.0) < 1.0
    if not w and not c:
        return DTYPE_LABELS.get(dtype, dtype) + (f", sparse {p['attn_sparsity']:g}" if sparse else "")
    suffix = "-S" if sparse else ""
    fitted = sorted({x.get("method", "rtn") for x in (w, c) if x} - {"rtn"})
    method = "".join(f" {m}" for m in fitted)
    # weights in one group per output channel (the int8 kernel's grid), not groups of some size
    grid = " per-channel" if w and w.get("group_size") == PER_CHANNEL else ""
    if w and c and w["bits"] == c["bits"]:
        return f"{w['bits']}-bit{suffix}{method}{grid}"
    parts = [f"{x['bits']}-bit {what}" for what, x in (("weights", w), ("cache", c)) if x]
    method += grid
    return ", ".join(parts) + suffix + method


# What the weights of each setting are, by the quantizer a setting name ends with (setting_name)
WEIGHTS_MEANING = {
    "": "re-quantized by FlexGen's min/max round-to-nearest onto the deployment's groups (64 unless it says "
        "otherwise): a GGUF's weights are dequantized first, then quantized again onto that grid",
    "per-channel": "re-quantized by min/max round-to-nearest with one scale and minimum per output channel (the "
                   "grid of torch's int8 weight-only matmul, coarser than groups of 64)",
    "hqq": "re-quantized onto the deployment's groups with each group's scale and minimum fitted (HQQ-style)",
    "gptq": "re-quantized onto the deployment's groups by GPTQ against calibration text the model samples",
    "gguf": "the GGUF file's own codes, scales and minimums, as they are (groups of 32; each weight at its file's "
            "width, e.g. Q4_1 at 4 bits, a Q8_0 embedding at 8): no re-quantization",
}


def weights_meaning(name: str) -> str:
    """Which weights a setting name (setting_name) computes with, in a sentence."""
    if name.split(",")[0] in DTYPE_LABELS.values():
        return "the source's weights as they are (a GGUF's dequantized), in that dtype"
    method = name.split(" ")[-1] if name.split(" ")[-1] in WEIGHTS_MEANING else ""
    if "-bit" not in name or ("cache" in name and "weights" not in name):
        return "the source's weights as they are (the KV cache alone compressed)"
    return WEIGHTS_MEANING[method]


def setting_rank(name: str) -> tuple:
    """Sort key of setting names, in the paper's order: uncompressed first, then by bits from
    most to fewest (8-bit, 4-bit, ...), each setting before its -S variant."""
    if name.split(",")[0] in DTYPE_LABELS.values():
        return (0, 0, name)
    bits = name.split("-bit")[0]
    return (1, -int(bits), name) if bits.isdigit() else (2, 0, name)
