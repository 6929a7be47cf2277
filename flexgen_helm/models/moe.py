"""Mixture-of-experts transformers: Mixtral, Qwen2-MoE (Qwen1.5-MoE), Qwen3-MoE, OLMoE, gpt-oss.

The Llama block (RMSNorm, rotary, grouped-query attention) whose MLP is a router and
`num_experts` gated MLPs: each token goes through the `experts_per_token` experts its
router's softmax ranks highest, their outputs summed with those probabilities (Mixtral
always renormalises them to sum to one, the others where the config's norm_topk_prob says).
Qwen2-MoE adds a shared expert every token takes, scaled by a sigmoid gate, and both Qwen
families may keep a dense MLP in some blocks (mlp_only_layers, decoder_sparse_step). OLMoE
normalises the whole query and key projections (not each head) and may clamp q, k and v.
gpt-oss has biases on every attention projection, a learned sink logit per query head in
each attention softmax (the executor's attention applies it), sliding-window blocks between
global ones, YaRN rotary scaling, a router with a bias whose top k logits are softmaxed
alone, and experts with biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate)).

Experts are ordinary store tensors, one per expert and projection
("layers.{i}.experts.{e}.gate_proj.weight"), so they are placed by fraction over the tiers
and compressed like any weight. The experts are computed grouped (`expert_mlp`): the rows of
everything the call holds (in a decode step, every GPU batch of the block: the schedule's
merged step) gathered per expert, multiplied once per expert, and added back with their
routing weights.
"""

from __future__ import annotations

import dataclasses

import torch

from flexgen_helm.errors import ModelNotFoundError
from flexgen_helm.models import llama
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.gated_mlp import gated_mlp
from flexgen_helm.models.heads import split_heads
from flexgen_helm.models.hf_config import as_pairs, rope_from_hf, sliding_windows
from flexgen_helm.models.linear import linear
from flexgen_helm.models.llama import embed, head, run_constants, step_constants  # noqa: F401 (shared)
from flexgen_helm.models.norms import rms_norm
from flexgen_helm.models.rotary import RotaryAt
from flexgen_helm.models.spec import SINKS, LayerSpec, tensor

# transformers' model_type of each MoE family we run (the others are refused by name)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# config.json keys that mark a checkpoint as a mixture of experts (any family's)
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


# The geometries of published MoE checkpoints (their config.json's fields that matter here), for
# benchmarks with dummy weights (`flexgen-helm bench --model olmoe-1b-7b --dummy`)
GEOMETRIES = {
    "allenai/olmoe-1b-7b-0924": {  # 6.9B parameters, 1.3B active
        "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "eos_token_id": 50279, "pad_token_id": 1},
    "qwen/qwen3-30b-a3b": {  # 30.5B parameters, 3.3B active
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "max_position_embeddings": 40960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645},
    "mistralai/mixtral-8x7b-v0.1": {  # 46.7B parameters, 12.9B active
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    # 20.9B parameters, 3.6B active; published with MXFP4 experts (dequantized at conversion:
    # weights/mxfp4.py), its quantization_config left out here (dummy weights are the store's dtype)
    "openai/gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 4096},
        "swiglu_limit": 7.0, "attention_bias": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "eos_token_id": 200002, "pad_token_id": 199999},
}
GEOMETRY_ALIASES = {"olmoe-1b-7b": "allenai/olmoe-1b-7b-0924", "qwen3-30b-a3b": "qwen/qwen3-30b-a3b",
                    "mixtral-8x7b": "mistralai/mixtral-8x7b-v0.1", "gpt-oss-20b": "openai/gpt-oss-20b"}


def geometry(model: str) -> ModelConfig | None:
    """The config of a known MoE checkpoint by its Hugging Face name or alias (any case), else None."""
    name = GEOMETRY_ALIASES.get(model.lower(), model.lower())
    return config_from_hf(GEOMETRIES[name], name) if name in GEOMETRIES else None


def refuse_unsupported(model_type: str, hf: dict, where: str) -> None:
    """An MoE config of a family we do not run: one error naming it and those we do."""
    if model_type not in MOE_MODEL_TYPES and any(hf.get(k) for k in MOE_CONFIG_KEYS):
        raise ModelNotFoundError(
            f"{where}: mixture-of-experts family {model_type!r} is not supported "
            f"(supported mixture-of-experts families: {', '.join(MOE_MODEL_TYPES)})")


def _dense_blocks(hf: dict, n: int) -> tuple:
    """Qwen's blocks with a dense MLP: those listed in mlp_only_layers, and all but every
    decoder_sparse_step-th (as transformers' Qwen2MoeDecoderLayer picks them)."""
    only, step = set(hf.get("mlp_only_layers") or ()), hf.get("decoder_sparse_step") or 1
    return tuple(i for i in range(n) if i in only or (i + 1) % step != 0)


def config_from_hf(hf: dict, name: str) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type == "gpt_oss":
        return _gpt_oss_config(hf, name)
    base = llama.config_from_hf(hf, name)
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    qwen = model_type in ("qwen2_moe", "qwen3_moe")
    return dataclasses.replace(
        base,
        family="moe",
        moe_type=model_type,
        num_experts=int(experts),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_ffn_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        # Mixtral's router always renormalises; the others' configs say (transformers' default: no)
        norm_topk_prob=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        routing_in_float=model_type == "mixtral",
        shared_expert_ffn_size=int(hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0,
        dense_blocks=_dense_blocks(hf, base.num_layers) if qwen else (),
        attention_bias=bool(hf.get("qkv_bias", True)) if model_type == "qwen2_moe" else base.attention_bias,
        qk_norm=model_type in ("qwen3_moe", "olmoe"),
        qk_norm_whole=model_type == "olmoe",
        clip_qkv=float(hf.get("clip_qkv") or 0.0) if model_type == "olmoe" else 0.0,
    )


# gpt-oss's defaults where its config.json leaves a field out (transformers' GptOssConfig)
GPT_OSS_DEFAULTS = {"rope_theta": 150000.0, "sliding_window": 128, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 4096}}


def _gpt_oss_config(hf: dict, name: str) -> ModelConfig:
    """gpt-oss: the Llama block's fields, with its own defaults; sliding windows on the blocks
    its layer_types says (transformers' default: every even block), biases everywhere."""
    hf = dict(hf)
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_scaling"] = GPT_OSS_DEFAULTS["rope_scaling"]
    theta, scaling = rope_from_hf(hf, default_theta=GPT_OSS_DEFAULTS["rope_theta"])
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window", GPT_OSS_DEFAULTS["sliding_window"])
    base = dataclasses.replace(llama.config_from_hf({**hf, "model_type": "llama", "sliding_window": None}, name),
                               rope_theta=theta, rope_scaling=as_pairs(scaling),
                               sliding_windows=sliding_windows(hf, n, window, lambda i: i % 2 == 0))
    return dataclasses.replace(
        base,
        family="moe",
        moe_type="gpt_oss",
        num_experts=int(hf.get("num_local_experts") or hf["num_experts"]),
        experts_per_token=int(hf.get("num_experts_per_tok") or hf["experts_per_token"]),
        expert_ffn_size=int(hf["intermediate_size"]),
        attention_bias=bool(hf.get("attention_bias", True)),
        output_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        mlp_bias=True,
        softmax_after_topk=True,
        swiglu_limit=float(hf.get("swiglu_limit", GPT_OSS_DEFAULTS["swiglu_limit"])),
        swiglu_alpha=float(hf.get("swiglu_alpha", GPT_OSS_DEFAULTS["swiglu_alpha"])),
    )


def expected_experts_touched(num_experts: int, per_token: int, tokens: float) -> float:
    """Experts of one block that `tokens` rows choose between them, expected, each row taking
    `per_token` of `num_experts` at random: an expert escapes one row with probability
    1 - k/E, so E * (1 - (1 - k/E) ** tokens) (a batch-1 decode step: k; a large block: E).
    Real routers are not uniform (some experts are popular): fewer in practice."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def _gpt_oss_hf_config(cfg: ModelConfig) -> dict:
    """gpt-oss's config.json fields (inverse of _gpt_oss_config)."""
    windows = set(cfg.sliding_windows) - {0}
    if len(windows) > 1 or cfg.output_bias != cfg.attention_bias:
        raise ModelNotFoundError(f"{cfg.name}: gpt-oss takes one sliding window and biases on all of its attention "
                                 "projections or none; this config cannot be written as one")
    return {"model_type": "gpt_oss", "architectures": [_ARCHITECTURES["gpt_oss"]],
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "intermediate_size": cfg.expert_ffn_size, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token, "attention_bias": cfg.attention_bias,
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha,
            "sliding_window": windows.pop() if windows else None,
            "layer_types": ["sliding_attention" if cfg.window(i) else "full_attention" for i in range(cfg.num_layers)],
            "rope_parameters": {"rope_type": "default", **cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}}


def hf_config(cfg: ModelConfig) -> dict:
    """The transformers config.json fields of an MoE config (inverse of config_from_hf), beside
    the ones every family shares; sliding windows are not written back (refused) but gpt-oss's."""
    if cfg.moe_type == "gpt_oss":
        return _gpt_oss_hf_config(cfg)
    if cfg.sliding_windows:
        raise ModelNotFoundError(f"{cfg.name}: exporting an MoE config with sliding windows is not supported")
    out = {"model_type": cfg.moe_type, "architectures": [_ARCHITECTURES[cfg.moe_type]],
           "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_size, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu",
           "num_experts_per_tok": cfg.experts_per_token, "norm_topk_prob": cfg.norm_topk_prob,
           "num_local_experts" if cfg.moe_type == "mixtral" else "num_experts": cfg.num_experts}
    if cfg.rope_scaling:
        out["rope_scaling"] = cfg.rope_scaling_dict
    if cfg.moe_type in ("qwen2_moe", "qwen3_moe"):
        out.update(moe_intermediate_size=cfg.expert_ffn_size, decoder_sparse_step=1,
                   mlp_only_layers=list(cfg.dense_blocks))
    else:
        out["intermediate_size"] = cfg.expert_ffn_size  # Mixtral's and OLMoE's experts are the MLP's size
    if cfg.moe_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_ffn_size, qkv_bias=cfg.attention_bias)
    else:
        out["attention_bias"] = cfg.attention_bias
    if cfg.moe_type == "olmoe":
        out["clip_qkv"] = cfg.clip_qkv or None
    return out


def expert_key(e: int, proj: str, param: str = "weight") -> str:
    return f"experts.{e}.{proj}.{param}"


def moe_tensors(cfg: ModelConfig, n: str) -> list:
    """The router, each expert's gate, up and down projections (with their biases where
    mlp_bias), and the shared expert with its gate."""
    h, f, E = cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts
    ts = [tensor(n, "router.weight", E, h), *([tensor(n, "router.bias", E)] if cfg.mlp_bias else [])]
    for e in range(E):
        ts += [tensor(n, expert_key(e, "gate_proj"), f, h), tensor(n, expert_key(e, "up_proj"), f, h),
               tensor(n, expert_key(e, "down_proj"), h, f)]
        if cfg.mlp_bias:
            ts += [tensor(n, expert_key(e, "gate_proj", "bias"), f), tensor(n, expert_key(e, "up_proj", "bias"), f),
                   tensor(n, expert_key(e, "down_proj", "bias"), h)]
    if cfg.shared_expert_ffn_size:
        s = cfg.shared_expert_ffn_size
        ts += [tensor(n, "shared_expert.gate_proj.weight", s, h), tensor(n, "shared_expert.up_proj.weight", s, h),
               tensor(n, "shared_expert.down_proj.weight", h, s), tensor(n, "shared_expert_gate.weight", 1, h)]
    return ts


def _attention_tensors(cfg: ModelConfig, n: str) -> list:
    ts = llama.attention_tensors(cfg, n)
    if cfg.output_bias:
        ts.append(tensor(n, "o_proj.bias", cfg.hidden_size))
    if cfg.attention_sinks:
        ts.append(tensor(n, SINKS, cfg.num_heads))
    if not cfg.qk_norm_whole:
        return ts
    widths = {"q_norm.weight": cfg.num_heads * cfg.head_dim, "k_norm.weight": cfg.num_kv_heads * cfg.head_dim}
    return [tensor(n, t.key, widths[t.key]) if t.key in widths else t for t in ts]


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    h = cfg.hidden_size

    def block(n: str) -> list:  # n: "layers.{i}"
        mlp = moe_tensors(cfg, n) if cfg.sparse_block(int(n.split(".")[1])) else llama.mlp_tensors(cfg, n)
        return [tensor(n, "attn_norm.weight", h), *_attention_tensors(cfg, n), tensor(n, "mlp_norm.weight", h), *mlp]

    return llama.stacked_layers(cfg, block)


def qkv(cfg: ModelConfig, w: dict, h: torch.Tensor, at: RotaryAt, block: int):
    x = rms_norm(h, w["attn_norm.weight"], cfg.rms_norm_eps)
    if not cfg.qk_norm_whole:
        q, k, v = llama.project_heads(cfg, w, x, rms_norm)
    else:  # OLMoE: norms over the whole projections, then the clamp, then the heads
        eps = cfg.rms_norm_eps
        q = rms_norm(linear(x, w["q_proj.weight"], w.get("q_proj.bias")), w["q_norm.weight"], eps)
        k = rms_norm(linear(x, w["k_proj.weight"], w.get("k_proj.bias")), w["k_norm.weight"], eps)
        v = linear(x, w["v_proj.weight"], w.get("v_proj.bias"))
        if cfg.clip_qkv:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = split_heads(q, cfg.num_heads), split_heads(k, cfg.num_kv_heads), split_heads(v, cfg.num_kv_heads)
    return at.apply(q), at.apply(k), v


def route(cfg: ModelConfig, router, x: torch.Tensor, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x (n, hidden): the routing weights (n, k) and the experts chosen (n, k),
    as transformers' routers compute them (softmax in float32, then the top k; gpt-oss's:
    the top k logits, then their softmax in x's dtype)."""
    logits = linear(x, router, bias)
    if cfg.softmax_after_topk:
        top, chosen = torch.topk(logits, cfg.experts_per_token, dim=-1)
        return torch.softmax(top, dim=-1), chosen
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if cfg.routing_in_float else weights.to(x.dtype)), chosen


def expert_mlp(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    """The experts' output for x (..., hidden): every row's (token, choice) pairs sorted by
    expert, each expert's rows gathered (index_select; a decode step's all at once,
    GATHERED_ELEMENTS) and multiplied once, then added back to their tokens with their
    routing weights. torch's grouped_mm would need the
    experts as one (E, out, in) tensor, which the store keeps apart (placed and compressed per
    expert), and a compressed expert multiplies itself; one matmul per expert it is."""
    flat = x.reshape(-1, x.shape[-1])
    # the shared expert first: its weights' dense copies (compressed weights) are held to the
    # layer's end anyway, so the block's peak is the rest of its copies and one routed
    # expert's, as the planner counts it (planner/cost_model.dequantized_numel)
    shared = None
    if cfg.shared_expert_ffn_size:
        shared = torch.sigmoid(linear(flat, w["shared_expert_gate.weight"])) * gated_mlp(
            flat, w["shared_expert.gate_proj.weight"], w["shared_expert.up_proj.weight"],
            w["shared_expert.down_proj.weight"], cfg.mlp_activation)
    weights, chosen = route(cfg, w["router.weight"], flat, w.get("router.bias"))
    k = cfg.experts_per_token
    order = torch.argsort(chosen.reshape(-1), stable=True)
    counts = torch.bincount(chosen.reshape(-1), minlength=cfg.num_experts).tolist()  # one sync per layer
    # weights that load as the router asks (executor/expert_weights.py): the block's rows all
    # come in this one call (a decode step's merged batches, a prefill's gathered ones)
    if hasattr(w, "fetch"):
        w.fetch([e for e, count in enumerate(counts) if count])
    rows, slot_weights = order // k, weights.reshape(-1)[order]
    out = torch.zeros_like(flat)
    if rows.numel() * flat.shape[-1] <= GATHERED_ELEMENTS and max(counts) < EXPERT_PADDED_FROM:
        _experts_gathered(cfg, w, flat, chosen, order, slot_weights, counts, out)
    else:
        _experts_one_by_one(cfg, w, flat, rows, slot_weights, counts, out)
    if shared is not None:
        out.add_(shared)
    return out.reshape(x.shape)


# expert_mlp gathers the rows of all its experts at once (one gather, one scatter) where they
# hold at most this many elements and no expert has rows to pad (_padded): a decode step's
# few rows an expert, where each expert's own gather, weighting and scatter-add took ~13 us
# beside its ~140 us of products (OLMoE-1B-7B, 4-bit, 16 rows: runs/bench/moe_decode_step).
# A prefill's rows (8,192 tokens x 8 choices of OLMoE: 268 MB in bf16) go expert by expert,
# so that only one expert's rows are copied at a time.
GATHERED_ELEMENTS = 1 << 22


def _experts_one_by_one(cfg: ModelConfig, w: dict, flat: torch.Tensor, rows: torch.Tensor,
                        slot_weights: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    """expert_mlp's experts each over its own rows, gathered, multiplied and added back to
    their tokens in turn, by expert: each token's outputs summed in the order of their
    experts, rounded to out's dtype after each."""
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        picked = rows[start:start + count]
        y = _expert(cfg, w, e, flat.index_select(0, _padded(picked)))[:count]
        out.index_add_(0, picked, (y * slot_weights[start:start + count, None]).to(out.dtype))
        start += count
        if hasattr(w, "release"):  # its rows are done: one expert read off its tier held at a time
            w.release(e)


def _experts_gathered(cfg: ModelConfig, w: dict, flat: torch.Tensor, chosen: torch.Tensor, order: torch.Tensor,
                      slot_weights: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    """_experts_one_by_one's sums over every (token, choice) row gathered at once (order:
    the flat choices sorted by expert): each expert multiplies its slice, then each token's
    weighted outputs are put in the order of their experts and added to out one choice at a
    time, so that each sum rounds as there. (One index_add_ of all the rows would not: torch
    2.13's CPU index_add_ in a 16-bit dtype sums a call's rows into a token in float32 and
    rounds once; on CUDA its atomic adds come in no fixed order.)"""
    n, k = chosen.shape
    gathered = flat.index_select(0, order // k)
    outputs = None  # in the experts' output dtype, as the one-by-one path weights them
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        y = _expert(cfg, w, e, gathered[start:start + count])
        if outputs is None:
            outputs = gathered.new_empty((gathered.shape[0], y.shape[-1]), dtype=y.dtype)
        outputs[start:start + count] = y
        start += count
        if hasattr(w, "release"):  # its rows are done: one expert read off its tier held at a time
            w.release(e)
    if outputs is None:  # no rows
        return
    # a choice's rank among its token's choices by expert: where its output goes
    rank = torch.empty_like(chosen).scatter_(1, chosen.argsort(1), torch.arange(k, device=chosen.device).expand(n, k))
    slots = order - order % k + rank.reshape(-1)[order]
    by_token = torch.empty_like(outputs, dtype=out.dtype).index_copy_(
        0, slots, (outputs * slot_weights[:, None]).to(out.dtype)).view(n, k, out.shape[-1])
    for j in range(k):
        out.add_(by_token[:, j])


# An expert multiplying many rows (a prefill's gathered block) takes them padded up to the
# next of ROW_COUNTS_PER_OCTAVE row counts an octave (at most 1/16 more rows), repeating its
# first: oneDNN builds a kernel for every row count it multiplies and keeps the last 1024
# (~280 KB each: a 4-bit OLMoE-1B-7B run held 0.29 GiB more with them than with a cache of 16),
# and a prefill's experts each meet their own count. Building one took 7-10 ms on average on a
# 2-core AMX Xeon, against 4.4 ms for a 1024 x 2048 x 1024 bf16 product: OLMoE-1B-7B's prefill
# (dummy weights: 44-3,328 rows an expert, padded) built 397 kernels on multiples of 16 rows,
# 3.5-3.7 s of 36-45 s, and 221 this way, 1.8-2.0 s (runs/bench/row_buckets). Rows are
# independent, so a row's output does not depend on its companions.
ROW_COUNTS_PER_OCTAVE = 16
EXPERT_PADDED_FROM = 256  # below, a decode step's few rows an expert: their counts recur


def padded_row_count(rows: int) -> int:
    """`rows` rounded up to the next of ROW_COUNTS_PER_OCTAVE counts in its octave."""
    step = 1 << max(0, rows.bit_length() - ROW_COUNTS_PER_OCTAVE.bit_length())
    return -(-rows // step) * step


def _padded(picked: torch.Tensor) -> torch.Tensor:
    short = padded_row_count(len(picked)) - len(picked)
    if len(picked) < EXPERT_PADDED_FROM or not short or picked.device.type != "cpu":  # (oneDNN's cache: a CPU's)
        return picked
    return torch.cat((picked, picked[:1].expand(short)))


def _expert(cfg: ModelConfig, w: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's output for rows x."""
    if not cfg.swiglu_limit:
        return gated_mlp(x, w[expert_key(e, "gate_proj")], w[expert_key(e, "up_proj")], w[expert_key(e, "down_proj")],
                         cfg.mlp_activation)
    limit = cfg.swiglu_limit
    gate = linear(x, w[expert_key(e, "gate_proj")], w[expert_key(e, "gate_proj", "bias")]).clamp(max=limit)
    up = linear(x, w[expert_key(e, "up_proj")], w[expert_key(e, "up_proj", "bias")]).clamp(-limit, limit)
    glu = gate * torch.sigmoid(gate * cfg.swiglu_alpha)
    return linear((up + 1) * glu, w[expert_key(e, "down_proj")], w[expert_key(e, "down_proj", "bias")])


def attention_output(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The first half of finish_block: the residual stream after attention."""
    return h + linear(attn, w["o_proj.weight"], w.get("o_proj.bias"))


def mlp_output(cfg: ModelConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    """The second half: after the MLP (the experts, or a dense block's MLP), for any rows of
    the block together (a prefill's GPU batches gathered: executor/schedule.py)."""
    x = rms_norm(h, w["mlp_norm.weight"], cfg.rms_norm_eps)
    # the residual added into the MLP's own output (the same sums: addition commutes), so a
    # gathered prefill holds no fourth block-sized tensor at its peak
    if "router.weight" in w:
        return expert_mlp(cfg, w, x).add_(h)
    return gated_mlp(x, w["gate_proj.weight"], w["up_proj.weight"], w["down_proj.weight"], cfg.mlp_activation).add_(h)


def finish_block(cfg: ModelConfig, w: dict, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    return mlp_output(cfg, w, attention_output(cfg, w, h, attn))
