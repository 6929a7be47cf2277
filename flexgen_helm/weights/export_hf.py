"""Write a weight source (OPT, Llama family, mixtures of experts) as a Hugging Face checkpoint
directory (config.json, sharded safetensors, tokenizer), so that other systems (transformers, HELM's HuggingFaceClient,
accelerate) can run the very same weights side by side with ours."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.devices import DTYPE_NAMES
from flexgen_helm.models import moe
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.weights.hf_checkpoint import HF_NAMES, fused_expert_part
from flexgen_helm.weights.source import WeightSource, rename

_PREFIX = {"opt": "model.", "llama": "model.", "moe": "model."}


def hf_config(cfg: ModelConfig) -> dict:
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "max_position_embeddings": cfg.max_seq_len,
              "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
              "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.family == "opt":
        return {**common, "model_type": "opt", "architectures": ["OPTForCausalLM"], "ffn_dim": cfg.ffn_size,
                "word_embed_proj_dim": cfg.word_embed_proj_dim, "do_layer_norm_before": cfg.do_layer_norm_before,
                "activation_function": "relu", "enable_bias": True}
    if cfg.family == "moe":
        return {**common, **moe.hf_config(cfg)}
    if cfg.family != "llama" or cfg.qk_norm or cfg.sliding_windows:
        raise FlexGenError(f"{cfg.name}: exporting a Hugging Face checkpoint covers OPT, the Llama family without "
                           f"q/k norms or sliding windows (Llama, Mistral v0.2+, Qwen2) and the mixtures of experts, "
                           f"not this {cfg.family} config")
    model_type = "qwen2" if cfg.attention_bias else "llama"
    out = {**common, "model_type": model_type,
           "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
           "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_size, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "hidden_act": "silu"}
    if cfg.rope_scaling:
        out["rope_scaling"] = cfg.rope_scaling_dict
    return out


def export_hf(source: WeightSource, out_dir: str | Path, dtype: torch.dtype = torch.float32,
              shard_bytes: int = 2 * 2**30, tokenizer=None, progress: bool = True) -> Path:
    """Streams tensors into shards of at most `shard_bytes`, so RAM stays bounded."""
    cfg = source.config
    config = {**hf_config(cfg), "torch_dtype": DTYPE_NAMES[dtype]}  # first: an unsupported config fails before writing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = HF_NAMES.get(cfg.moe_type) or HF_NAMES[cfg.family]
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map, size = {}, 0
    fusing: dict[str, list] = {}  # gpt-oss's fused expert tensors being filled: name -> [tensor, pieces in]
    for store_name, t in tqdm(source.iter_tensors(), total=len(source.tensor_specs()), desc="exporting",
                              unit="tensor", disable=not progress):
        part = fused_expert_part(cfg.moe_type, store_name)
        if part is not None:
            hf_name, t = part[0], _fused(fusing, *part, t, cfg.num_experts)
            if t is None:
                continue
        else:
            hf_name = rename(store_name, names)
        hf_name = hf_name if hf_name.startswith("lm_head") else _PREFIX[cfg.family] + hf_name
        t = t.to(dtype).contiguous()
        if size and size + t.nbytes > shard_bytes:
            _write_shard(out, shards, len(shards))
            shards.append({})
            size = 0
        shards[-1][hf_name] = t
        weight_map[hf_name] = len(shards)
        size += t.nbytes
    _write_shard(out, shards, len(shards))
    total = len(shards)
    files = {i: f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)}
    for i in range(1, total + 1):
        (out / f"shard-{i}.tmp").rename(out / files[i])
    index = {"metadata": {}, "weight_map": {k: files[v] for k, v in weight_map.items()}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _fused(fusing: dict, name: str, e: int, columns: int | None, t: torch.Tensor,
           num_experts: int) -> torch.Tensor | None:
    """Expert e's piece `t` ((out, in), as the store holds it) put in its place in the fused
    gpt-oss tensor `name` ((E, in, out), gate and up interleaved: hf_checkpoint.GPT_OSS_EXPERTS);
    that tensor once every expert's pieces are in, else None. One fused tensor (a layer's
    experts' projection) is held at a time, as the store's tensors come in layer order."""
    piece = t.T if t.dim() == 2 else t
    if name not in fusing:
        width = piece.shape[-1] * (1 if columns is None else 2)
        fusing[name] = [torch.empty(num_experts, *piece.shape[:-1], width, dtype=piece.dtype), 0]
    entry = fusing[name]
    if columns is None:
        entry[0][e] = piece
    else:
        entry[0][e][..., columns::2] = piece
    entry[1] += 1
    if entry[1] < num_experts * (1 if columns is None else 2):
        return None
    return fusing.pop(name)[0]


def _write_shard(out: Path, shards: list, index: int) -> None:
    if shards[-1]:
        save_file(shards[-1], str(out / f"shard-{index}.tmp"), metadata={"format": "pt"})
        shards[-1] = {}
