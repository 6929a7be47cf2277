"""A Hugging Face checkpoint directory: config.json plus *.safetensors or *.bin shards.

Tensors are read one at a time: safetensors through safe_open (memory-mapped), .bin
through torch.load(mmap=True, weights_only=True), which never runs pickled code and
never pulls the whole shard into RAM.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from flexgen_helm.errors import ModelNotFoundError, WeightStoreError
from flexgen_helm.models import FAMILIES, HF_MODEL_TYPES
from flexgen_helm.models.moe import refuse_unsupported
from flexgen_helm.models.spec import SINKS
from flexgen_helm.models.tokenizer import hf_tokenizer
from flexgen_helm.weights import mxfp4
from flexgen_helm.weights.source import WeightSource, rename

# Store module name -> Hugging Face module name, without the "model." prefix that the
# *ForCausalLM classes add (bare *Model checkpoints lack it).
HF_NAMES = {
    "opt": {
        "embed.tokens": "decoder.embed_tokens",
        "embed.positions": "decoder.embed_positions",
        "embed.project_in": "decoder.project_in",
        "layers.{i}.attn_norm": "decoder.layers.{i}.self_attn_layer_norm",
        "layers.{i}.q_proj": "decoder.layers.{i}.self_attn.q_proj",
        "layers.{i}.k_proj": "decoder.layers.{i}.self_attn.k_proj",
        "layers.{i}.v_proj": "decoder.layers.{i}.self_attn.v_proj",
        "layers.{i}.o_proj": "decoder.layers.{i}.self_attn.out_proj",
        "layers.{i}.mlp_norm": "decoder.layers.{i}.final_layer_norm",
        "layers.{i}.fc1": "decoder.layers.{i}.fc1",
        "layers.{i}.fc2": "decoder.layers.{i}.fc2",
        "head.norm": "decoder.final_layer_norm",
        "head.project_out": "decoder.project_out",
        "head.lm_head": "lm_head",
    },
}
_LLAMA_ATTENTION = {
    "embed.tokens": "embed_tokens",
    "layers.{i}.attn_norm": "layers.{i}.input_layernorm",
    "layers.{i}.q_proj": "layers.{i}.self_attn.q_proj",
    "layers.{i}.k_proj": "layers.{i}.self_attn.k_proj",
    "layers.{i}.v_proj": "layers.{i}.self_attn.v_proj",
    "layers.{i}.q_norm": "layers.{i}.self_attn.q_norm",
    "layers.{i}.k_norm": "layers.{i}.self_attn.k_norm",
    "layers.{i}.o_proj": "layers.{i}.self_attn.o_proj",
    "head.norm": "norm",
    "head.lm_head": "lm_head",
}
_GATED_MLP = {
    "layers.{i}.gate_proj": "layers.{i}.mlp.gate_proj",
    "layers.{i}.up_proj": "layers.{i}.mlp.up_proj",
    "layers.{i}.down_proj": "layers.{i}.mlp.down_proj",
}
HF_NAMES["llama"] = {**_LLAMA_ATTENTION, **_GATED_MLP, "layers.{i}.mlp_norm": "layers.{i}.post_attention_layernorm"}
# Gemma's post_attention_layernorm normalises the attention output, before the residual add
HF_NAMES["gemma"] = {**_LLAMA_ATTENTION, **_GATED_MLP,
                     "layers.{i}.post_attn_norm": "layers.{i}.post_attention_layernorm",
                     "layers.{i}.mlp_norm": "layers.{i}.pre_feedforward_layernorm",
                     "layers.{i}.post_mlp_norm": "layers.{i}.post_feedforward_layernorm"}
HF_NAMES["phi3"] = {**_LLAMA_ATTENTION, "layers.{i}.qkv_proj": "layers.{i}.self_attn.qkv_proj",
                    "layers.{i}.mlp_norm": "layers.{i}.post_attention_layernorm",
                    "layers.{i}.gate_up_proj": "layers.{i}.mlp.gate_up_proj",
                    "layers.{i}.down_proj": "layers.{i}.mlp.down_proj"}
# Mixture-of-experts blocks: the Llama attention; the router, the experts (and Qwen2-MoE's
# shared expert with its gate) under mlp, as Qwen and OLMoE name them, or under
# block_sparse_moe with w1 (gate), w3 (up), w2 (down), as Mixtral does; Qwen's dense blocks'
# MLP as Llama's
_MOE_COMMON = {**_LLAMA_ATTENTION, **_GATED_MLP, "layers.{i}.mlp_norm": "layers.{i}.post_attention_layernorm"}
HF_NAMES["moe"] = {**_MOE_COMMON, "layers.{i}.router": "layers.{i}.mlp.gate",
                   "layers.{i}.experts.{e}.gate_proj": "layers.{i}.mlp.experts.{e}.gate_proj",
                   "layers.{i}.experts.{e}.up_proj": "layers.{i}.mlp.experts.{e}.up_proj",
                   "layers.{i}.experts.{e}.down_proj": "layers.{i}.mlp.experts.{e}.down_proj",
                   "layers.{i}.shared_expert.gate_proj": "layers.{i}.mlp.shared_expert.gate_proj",
                   "layers.{i}.shared_expert.up_proj": "layers.{i}.mlp.shared_expert.up_proj",
                   "layers.{i}.shared_expert.down_proj": "layers.{i}.mlp.shared_expert.down_proj",
                   "layers.{i}.shared_expert_gate": "layers.{i}.mlp.shared_expert_gate"}
HF_NAMES["mixtral"] = {**_MOE_COMMON, "layers.{i}.router": "layers.{i}.block_sparse_moe.gate",
                       "layers.{i}.experts.{e}.gate_proj": "layers.{i}.block_sparse_moe.experts.{e}.w1",
                       "layers.{i}.experts.{e}.up_proj": "layers.{i}.block_sparse_moe.experts.{e}.w3",
                       "layers.{i}.experts.{e}.down_proj": "layers.{i}.block_sparse_moe.experts.{e}.w2"}
# gpt-oss: the Llama attention with its sinks, the router under mlp; its experts are fused
# tensors (GPT_OSS_EXPERTS), each expert's projections cut out of them as they are read
HF_NAMES["gpt_oss"] = {**_MOE_COMMON, "layers.{i}.attn": "layers.{i}.self_attn",
                       "layers.{i}.router": "layers.{i}.mlp.router"}
# gpt-oss's experts, stored fused over the experts: gate_up_proj (E, hidden, 2 * ffn) with the
# gate's and the up projection's columns interleaved (gate the even ones), gate_up_proj_bias
# (E, 2 * ffn), down_proj (E, ffn, hidden), down_proj_bias (E, hidden), all (in, out) where our
# store holds (out, in): store tensor "{proj}.{param}" of an expert -> (fused tensor, which of
# the interleaved columns: 0 even, 1 odd, None all)
GPT_OSS_EXPERTS = {"gate_proj.weight": ("gate_up_proj", 0), "up_proj.weight": ("gate_up_proj", 1),
                   "down_proj.weight": ("down_proj", None), "gate_proj.bias": ("gate_up_proj_bias", 0),
                   "up_proj.bias": ("gate_up_proj_bias", 1), "down_proj.bias": ("down_proj_bias", None)}
_FUSED_EXPERT = re.compile(r"layers\.(\d+)\.experts\.(\d+)\.(.+)")


def fused_expert_part(moe_type: str, store_name: str) -> tuple[str, int, int | None] | None:
    """Where a gpt-oss expert's store tensor lies in its fused one: (HF name without "model.",
    expert, which interleaved columns: 0 even, 1 odd, None all); None for any other tensor."""
    fused = _FUSED_EXPERT.fullmatch(store_name) if moe_type == "gpt_oss" else None
    if fused is None:
        return None
    name, columns = GPT_OSS_EXPERTS[fused[3]]
    return f"layers.{fused[1]}.mlp.experts.{name}", int(fused[2]), columns
# "model." of *ForCausalLM, none of a bare *Model, and the language model inside a multimodal
# Gemma 3 (transformers < 4.52 and >= 4.52 name it differently)
_PREFIXES = ("model.", "", "model.language_model.", "language_model.model.")


def read_hf_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"{model_dir}: no config.json; not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


class HFCheckpoint(WeightSource):
    def __init__(self, model_dir: str | Path, name: str | None = None):
        self.root = Path(model_dir)
        hf = read_hf_config(self.root)
        model_type = hf.get("model_type")
        refuse_unsupported(model_type, hf, str(self.root))
        if model_type != "gpt_oss":
            _refuse_mxfp4(hf, str(self.root))
        if model_type not in HF_MODEL_TYPES:
            raise ModelNotFoundError(
                f"{self.root}: model_type {model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})"
            )
        family = HF_MODEL_TYPES[model_type]
        self.config = FAMILIES[family].config_from_hf(hf, name or hf.get("_name_or_path") or self.root.name)
        self._names = HF_NAMES.get(self.config.moe_type) or HF_NAMES[family]
        self._open: dict[Path, object] = {}
        self._file_of = self._index_tensors()  # HF tensor name -> shard file
        # gpt-oss as OpenAI published it: its experts' weights as MXFP4 blocks and scales
        # (weights/mxfp4.py), dequantized as they are read
        self.mxfp4 = self.config.moe_type == "gpt_oss" and any(n.endswith(MXFP4_BLOCKS) for n in self._file_of)
        if self.config.is_moe:
            self._check_expert_tensors()

    @property
    def identity(self) -> str:
        files = sorted(set(self._file_of.values()))
        stamps = ",".join(f"{f.name}/{f.stat().st_size}/{f.stat().st_mtime_ns}" for f in files)
        return f"hf:{self.root.resolve()}:" + stamps

    def _index_tensors(self) -> dict[str, Path]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.root / index_name
            if index.is_file():
                return {k: self.root / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        for pattern in ("*.safetensors", "pytorch_model*.bin"):  # not training_args.bin and the like
            files = sorted(self.root.glob(pattern))
            if files:
                return {k: f for f in files for k in self._shard(f).keys()}
        raise WeightStoreError(f"{self.root}: no *.safetensors or pytorch_model*.bin weight files")

    def release(self) -> None:
        self._open.clear()  # safe_open handles and mmap-backed state dicts: their mappings go with them

    def _shard(self, file: Path):
        """An open shard (a safe_open handle or an mmap-backed state dict), kept for reuse."""
        if file not in self._open:
            if not file.is_file():
                raise WeightStoreError(f"{file}: weight shard listed in the index is missing")
            try:
                if file.suffix == ".safetensors":
                    self._open[file] = safe_open(str(file), framework="pt")
                else:
                    self._open[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            # safetensors and torch.load report a damaged shard as whatever they hit (SafetensorError,
            # pickle errors, RuntimeError, OSError): each is named, with the shard
            except Exception as e:
                raise WeightStoreError(f"{file}: cannot read weight shard ({type(e).__name__}: {e})") from e
        return self._open[file]

    def _fused_expert(self, store_name: str) -> tuple[str, int, int | None] | None:
        return fused_expert_part(self.config.moe_type, store_name)

    def _candidates(self, store_name: str) -> list[str]:
        fused = self._fused_expert(store_name)
        if fused is not None:
            as_mxfp4 = self.mxfp4 and store_name.endswith(".weight")  # the biases stay plain
            return [p + fused[0] + (MXFP4_BLOCKS if as_mxfp4 else "") for p in _PREFIXES]
        hf_name = rename(store_name, self._names)
        names = [p + hf_name for p in _PREFIXES]
        if store_name == "embed.tokens.weight" and self.config.tie_word_embeddings:
            names.append("lm_head.weight")  # a tied checkpoint may keep only the head's copy
        return names

    def _located(self, store_name: str) -> tuple[str, Path]:
        """(HF tensor name, shard file) of a store tensor; an error naming it and the files searched."""
        candidates = self._candidates(store_name)
        for hf_name in candidates:
            if hf_name in self._file_of:
                return hf_name, self._file_of[hf_name]
        files = ", ".join(sorted({f.name for f in self._file_of.values()}))
        raise WeightStoreError(
            f"{self.root}: tensor {candidates[0]!r} (store name {store_name}) not found in {files}"
        )

    def read(self, store_name: str) -> torch.Tensor:
        hf_name, file = self._located(store_name)
        shard = self._shard(file)
        fused = self._fused_expert(store_name)
        if fused is None:
            return shard.get_tensor(hf_name) if hasattr(shard, "get_tensor") else shard[hf_name]
        _, e, columns = fused
        if hf_name.endswith(MXFP4_BLOCKS):  # (out, in) once dequantized: gate and up interleaved by rows
            t = mxfp4.dequantize(self._expert_slice(hf_name, e), self._expert_slice(self._scales_of(hf_name), e))
            return (t if columns is None else t[columns::2]).contiguous()
        t = self._expert_slice(hf_name, e)
        if columns is not None:
            t = t[..., columns::2]
        return t.T.contiguous() if t.dim() == 2 else t.contiguous()

    def _expert_slice(self, hf_name: str, e: int) -> torch.Tensor:
        """Expert e's slice alone of a fused tensor (a safetensors slice reads only its bytes)."""
        shard = self._shard(self._file_of[hf_name])
        return shard.get_slice(hf_name)[e] if hasattr(shard, "get_slice") else shard[hf_name][e]

    def _scales_of(self, blocks_name: str) -> str:
        """The MXFP4 scales of a blocks tensor, present (else an error naming them and the files)."""
        name = blocks_name[:-len(MXFP4_BLOCKS)] + MXFP4_SCALES
        if name not in self._file_of:
            files = ", ".join(sorted({f.name for f in self._file_of.values()}))
            raise WeightStoreError(f"{self.root}: tensor {name!r} (the scales of MXFP4 {blocks_name!r}) not found "
                                   f"in {files}")
        return name

    def _check_expert_tensors(self) -> None:
        """Every router, expert and shared-expert tensor (and attention sink) present with its
        shape, from the shards' headers, before any is read: a missing or misshapen one is
        named with its file. A gpt-oss expert's is its fused tensor's, all experts' together."""
        for spec in self.tensor_specs():
            if not any(part in spec.store_name for part in (".router.", ".experts.", ".shared_expert", SINKS)):
                continue
            hf_name, file = self._located(spec.store_name)
            shape = self._slice_shape(hf_name)
            fused = self._fused_expert(spec.store_name)
            if fused is not None and hf_name.endswith(MXFP4_BLOCKS):
                shape = _mxfp4_expert_shape(shape, self._slice_shape(self._scales_of(hf_name)), fused[2])
            elif fused is not None:
                shape = _expert_shape(shape, fused[2])
            if shape != spec.shape:
                raise WeightStoreError(
                    f"{file}: tensor {hf_name!r} has shape {list(shape)}, expected {list(spec.shape)} for "
                    f"{self.config.num_experts} experts of {self.config.expert_ffn_size} x {self.config.hidden_size} "
                    f"(config.json); the checkpoint does not match its config")

    def _slice_shape(self, hf_name: str) -> tuple:
        """A tensor's shape, from its shard's header."""
        shard = self._shard(self._file_of[hf_name])
        return tuple(shard.get_slice(hf_name).get_shape() if hasattr(shard, "get_slice") else shard[hf_name].shape)

    def load_tokenizer(self, cache_dir: Path):
        return hf_tokenizer(self.root)


def _expert_shape(fused: tuple, columns: int | None) -> tuple | None:
    """The shape of one expert's store tensor cut out of a fused gpt-oss tensor of shape
    `fused` (HFCheckpoint.read); None where the fused one has none to cut."""
    if len(fused) < 2:
        return None
    one = list(fused[1:])
    if columns is not None:
        one[-1] = (one[-1] - columns + 1) // 2
    return tuple(reversed(one))


def _mxfp4_expert_shape(blocks: tuple, scales: tuple, columns: int | None) -> tuple | None:
    """The shape of one expert's store tensor dequantized out of MXFP4 blocks (E, out, groups,
    16) with scales (E, out, groups): (out, groups * 32), half the rows where `columns` takes
    every other; None where the two do not fit together."""
    if len(blocks) != 4 or blocks[:3] != scales or blocks[3] != 16:
        return None
    rows = blocks[1] if columns is None else (blocks[1] - columns + 1) // 2
    return rows, blocks[2] * 32


# gpt-oss's experts as OpenAI published them: MXFP4 blocks and their scales
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


def _refuse_mxfp4(hf: dict, where: str) -> None:
    """MXFP4 is read for gpt-oss's experts only: another model's is refused before any read."""
    if (hf.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        raise WeightStoreError(
            f"{where}: weights stored as MXFP4 (quantization_config quant_method 'mxfp4': tensors *_blocks and "
            f"*_scales) are read for gpt-oss's experts only, not for model_type {hf.get('model_type')!r}")
