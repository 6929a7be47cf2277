"""A random-weight GGUF of a mixture-of-experts geometry, written the way llama.cpp's
convert_hf_to_gguf.py lays one out, so that llama.cpp and we can run the very same file
(`flexgen-helm compare-llamacpp --path`): the MoE comparison of issue 49, with no checkpoint
to download.

    python -m flexgen_helm.tools.compare.random_moe_gguf --geometry olmoe-1b-7b --layers 4 \\
        --out /tmp/olmoe-4l-bf16.gguf

The geometry is one of models/moe.GEOMETRIES (the OLMoE one: llama.cpp's `olmoe` architecture),
optionally cut to fewer layers (each layer keeps its full size: experts, heads, widths), so the
file fits a disk and RAM next to both programs. Weights are bfloat16 (both sides multiply it
natively on a CPU with bf16 arithmetic), normal with a small standard deviation so that
activations stay finite through the layers; the norms (ones) and the routers are float32, as
llama.cpp's converter keeps them (its CPU ops multiply float32 activations by float32 norms).
The vocabulary is placeholder tokens: both benchmarks feed token ids, not text."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from flexgen_helm.errors import FlexGenError
from flexgen_helm.memory.disk_space import check_free_space
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.moe import GEOMETRY_ALIASES, geometry

# the families this writer lays out, by transformers' model_type -> llama.cpp's architecture
ARCHITECTURES = {"olmoe": "olmoe"}
WEIGHT_STD = 0.02


def moe_config(name: str, layers: int | None) -> ModelConfig:
    cfg = geometry(name)
    if cfg is None:
        raise FlexGenError(f"unknown MoE geometry {name!r} (known: {', '.join(sorted(GEOMETRY_ALIASES))})")
    if cfg.moe_type not in ARCHITECTURES:
        raise FlexGenError(f"{name}: writing a GGUF of the {cfg.moe_type!r} family is not supported "
                           f"(supported: {', '.join(ARCHITECTURES)})")
    if layers is not None:
        if not 1 <= layers <= cfg.num_layers:
            raise FlexGenError(f"--layers must be within 1..{cfg.num_layers} for {name}, got {layers}")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    return cfg


def file_bytes(cfg: ModelConfig) -> int:
    """The tensor bytes of the file, to check the disk before writing: bfloat16 matrices,
    float32 norms and routers."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    matrices = h * q * 2 + h * kv * 2 + 3 * cfg.num_experts * h * cfg.expert_ffn_size
    f32 = cfg.num_experts * h + 2 * h + q + kv
    return cfg.num_layers * (2 * matrices + 4 * f32) + 2 * 2 * cfg.vocab_size * h + 4 * h


def _bf16(shape: tuple[int, ...], gen: torch.Generator, std: float = WEIGHT_STD) -> np.ndarray:
    """Normal(0, std) values as bfloat16 bits (gguf takes bf16 as uint16 arrays)."""
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _f32(shape: tuple[int, ...], gen: torch.Generator, std: float) -> np.ndarray:
    return (torch.randn(shape, generator=gen) * std).numpy()


def write(cfg: ModelConfig, out: Path, seed: int = 0) -> None:
    if cfg.moe_type not in ARCHITECTURES:
        raise FlexGenError(f"{cfg.name}: writing a GGUF of the {cfg.moe_type!r} family is not supported "
                           f"(supported: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[cfg.moe_type]
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e, f = cfg.num_experts, cfg.expert_ffn_size
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"random {cfg.name} ({cfg.num_layers} layers)")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(h)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(f)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_expert_count(e)
    w.add_expert_used_count(cfg.experts_per_token)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    gen = torch.Generator().manual_seed(seed)
    bf16 = gguf.GGMLQuantizationType.BF16
    tensors = {"token_embd.weight": _bf16((cfg.vocab_size, h), gen), "output_norm.weight": _ones(h),
               "output.weight": _bf16((cfg.vocab_size, h), gen)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": _ones(h), b + "attn_q.weight": _bf16((q, h), gen),
            b + "attn_k.weight": _bf16((kv, h), gen), b + "attn_v.weight": _bf16((kv, h), gen),
            b + "attn_output.weight": _bf16((h, q), gen),
            # OLMoE normalises the whole query and key vectors (not per head)
            b + "attn_q_norm.weight": _ones(q), b + "attn_k_norm.weight": _ones(kv),
            b + "ffn_norm.weight": _ones(h), b + "ffn_gate_inp.weight": _f32((e, h), gen, 1.0 / h ** 0.5),
            b + "ffn_gate_exps.weight": _bf16((e, f, h), gen), b + "ffn_up_exps.weight": _bf16((e, f, h), gen),
            b + "ffn_down_exps.weight": _bf16((e, h, f), gen),
        })
    for name, data in tensors.items():
        w.add_tensor(name, data, raw_dtype=bf16 if data.dtype == np.uint16 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.compare.random_moe_gguf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", default="olmoe-1b-7b", help="an MoE geometry of models/moe.GEOMETRIES")
    p.add_argument("--layers", type=int, help="keep the first N layers (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    try:
        cfg = moe_config(args.geometry, args.layers)
        if args.out.exists():
            raise FlexGenError(f"{args.out} exists: not overwritten")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        check_free_space(args.out.parent, file_bytes(cfg), f"the GGUF of {cfg.name}",
                         "write it elsewhere (--out) or with fewer --layers")
        write(cfg, args.out, args.seed)
    except FlexGenError as err:
        print(f"random_moe_gguf: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB): {cfg.name}, {cfg.num_layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
