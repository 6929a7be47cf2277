"""What differs between llama.cpp's GGUF architectures that we read: the transformers
model_type each stands for, the GGUF names of our store's tensors, what llama.cpp's
converter (convert_hf_to_gguf.py) did to the tensors on the way in, and which metadata
keys hold each family's extra hyper-parameters (as a transformers config dict, so that
one function per family builds configs from either format)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from flexgen_helm.errors import WeightStoreError

_COMMON = {
    "embed.tokens": "token_embd",
    "layers.{i}.attn_norm": "blk.{i}.attn_norm",
    "layers.{i}.q_proj": "blk.{i}.attn_q",
    "layers.{i}.k_proj": "blk.{i}.attn_k",
    "layers.{i}.v_proj": "blk.{i}.attn_v",
    "layers.{i}.q_norm": "blk.{i}.attn_q_norm",
    "layers.{i}.k_norm": "blk.{i}.attn_k_norm",
    "layers.{i}.o_proj": "blk.{i}.attn_output",
    "layers.{i}.mlp_norm": "blk.{i}.ffn_norm",
    "layers.{i}.gate_proj": "blk.{i}.ffn_gate",
    "layers.{i}.up_proj": "blk.{i}.ffn_up",
    "layers.{i}.down_proj": "blk.{i}.ffn_down",
    "head.norm": "output_norm",
    "head.lm_head": "output",
    # Mixtral (written as "llama" with expert_count set): the router, and each projection of all
    # the experts of a block stacked in one (experts, out, in) tensor, read one expert at a time
    "layers.{i}.router": "blk.{i}.ffn_gate_inp",
    "layers.{i}.experts.{e}.gate_proj": "blk.{i}.ffn_gate_exps",
    "layers.{i}.experts.{e}.up_proj": "blk.{i}.ffn_up_exps",
    "layers.{i}.experts.{e}.down_proj": "blk.{i}.ffn_down_exps",
    # Qwen2-MoE's shared expert and its gate
    "layers.{i}.shared_expert.gate_proj": "blk.{i}.ffn_gate_shexp",
    "layers.{i}.shared_expert.up_proj": "blk.{i}.ffn_up_shexp",
    "layers.{i}.shared_expert.down_proj": "blk.{i}.ffn_down_shexp",
    "layers.{i}.shared_expert_gate": "blk.{i}.ffn_gate_inp_shexp",
}
_GEMMA = {**_COMMON, "layers.{i}.post_attn_norm": "blk.{i}.post_attention_norm",
          "layers.{i}.post_mlp_norm": "blk.{i}.post_ffw_norm"}  # pre_feedforward_layernorm is ffn_norm
# Phi-3's fused projections keep their HF row order: q, k, v rows; gate rows, then up rows
_PHI3 = {**_COMMON, "layers.{i}.qkv_proj": "blk.{i}.attn_qkv", "layers.{i}.gate_up_proj": "blk.{i}.ffn_up"}

Meta = Callable  # meta(key, default) -> the value of "{arch}.<key>", or default


def _gemma2(meta: Meta, hf: dict) -> dict:
    # llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim ** -0.5, but by
    # (hidden / heads) ** -0.5 for the 27B (46 blocks); attention.scale, where written, wins
    return {"sliding_window": meta("attention.sliding_window", 4096), "layer_types": _layer_types(meta, hf, 2),
            "attn_logit_softcapping": meta("attn_logit_softcapping", None),
            "final_logit_softcapping": meta("final_logit_softcapping", None),
            "query_pre_attn_scalar": _query_scalar(meta, hf, 46)}


def _gemma3(meta: Meta, hf: dict) -> dict:
    # llama.cpp: local blocks rotate with base 10000, unscaled; five of every six slide (27B: 62 blocks)
    return {"sliding_window": meta("attention.sliding_window", 4096), "layer_types": _layer_types(meta, hf, 6),
            "rope_theta": meta("rope.freq_base", 1_000_000.0),
            "rope_local_base_freq": meta("rope.freq_base_swa", 10_000.0),
            "attn_logit_softcapping": meta("attn_logit_softcapping", None),
            "final_logit_softcapping": meta("final_logit_softcapping", None),
            "query_pre_attn_scalar": _query_scalar(meta, hf, 62)}


def _layer_types(meta: Meta, hf: dict, default_pattern: int) -> list[str]:
    """llama.cpp's sliding_window_pattern: n (block i slides unless i % n == n - 1) or one
    flag per block; absent, the architecture's own n."""
    pattern = meta("attention.sliding_window_pattern", default_pattern)
    n = hf["num_hidden_layers"]
    flags = list(pattern) if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(n)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def _query_scalar(meta: Meta, hf: dict, blocks_of_27b: int) -> float:
    scale = meta("attention.scale", None)
    if scale:
        return scale ** -2
    if hf["num_hidden_layers"] == blocks_of_27b:
        return hf["hidden_size"] / hf["num_attention_heads"]
    return hf["head_dim"]


def _phi3(meta: Meta, hf: dict) -> dict:
    out = {"sliding_window": meta("attention.sliding_window", 0) or None,
           "original_max_position_embeddings": meta("rope.scaling.original_context_length", None),
           "partial_rotary_factor": meta("rope.dimension_count", hf["head_dim"]) / hf["head_dim"]}
    return {k: v for k, v in out.items() if v is not None}


def _experts(meta: Meta, norm_default: bool) -> dict:
    """The MoE keys llama.cpp writes, as transformers names them; whether the top-k weights
    are renormalised: expert_weights_norm where written, else what llama.cpp's graph of the
    architecture does (Qwen3-MoE: yes; Qwen2-MoE, OLMoE: no)."""
    used = meta("expert_used_count", 0)
    if not used:
        raise WeightStoreError("GGUF metadata expert_used_count is missing: how many experts each token takes "
                               "is not written")
    out = {"num_experts": meta("expert_count", 0), "num_experts_per_tok": used,
           "norm_topk_prob": bool(meta("expert_weights_norm", norm_default)),
           "moe_intermediate_size": meta("expert_feed_forward_length", None),
           "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length", None)}
    return {k: v for k, v in out.items() if v is not None}


def _llama(meta: Meta, hf: dict) -> dict:
    """A "llama" file with experts is a Mixtral (llama.cpp's converter writes it so)."""
    return {"model_type": "mixtral", **_experts(meta, True)} if meta("expert_count", 0) else {}


def _qwen2moe(meta: Meta, hf: dict) -> dict:
    return {**_experts(meta, False), "qkv_bias": hf["attention_bias"]}


def _olmoe(meta: Meta, hf: dict) -> dict:
    return {**_experts(meta, False), "clip_qkv": meta("attention.clamp_kqv", None)}


@dataclass(frozen=True)
class GGUFArch:
    model_type: str  # transformers' (HF_MODEL_TYPES picks our family from it)
    names: dict = field(default_factory=lambda: _COMMON)
    # llama.cpp's converter interleaves each head's rotary pairs in the Q and K rows of "llama"
    # files (Mistral is written as "llama"); every other architecture here keeps HF's order
    permuted: bool = False
    # ... and stores Gemma's norm weights as 1 + w (all of them: "*norm.weight")
    norm_offset: float = 0.0
    extra: Callable[[Meta, dict], dict] = lambda meta, hf: {}


ARCHITECTURES = {
    "llama": GGUFArch("llama", permuted=True, extra=_llama),
    "qwen2": GGUFArch("qwen2"),
    "qwen3": GGUFArch("qwen3"),
    "gemma2": GGUFArch("gemma2", _GEMMA, norm_offset=1.0, extra=_gemma2),
    "gemma3": GGUFArch("gemma3_text", _GEMMA, norm_offset=1.0, extra=_gemma3),
    "phi3": GGUFArch("phi3", _PHI3, extra=_phi3),
    "qwen2moe": GGUFArch("qwen2_moe", extra=_qwen2moe),
    "qwen3moe": GGUFArch("qwen3_moe", extra=lambda meta, hf: _experts(meta, True)),
    "olmoe": GGUFArch("olmoe", extra=_olmoe),
}
