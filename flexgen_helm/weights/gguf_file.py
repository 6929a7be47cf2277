"""A llama.cpp GGUF file (Llama-family architectures): config from its metadata, tensors
dequantized to float one at a time.

Two things differ from a Hugging Face checkpoint and are undone here: GGUF lists shapes
innermost-first (a Linear weight (out, in) shows as [in, out]), and llama.cpp's converter
permutes the rows of the Q and K projections of "llama" models to interleave each head's
rotary pairs; our math (like transformers') rotates halves, so the rows go back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from flexgen_helm.errors import ModelNotFoundError, WeightStoreError
from flexgen_helm.models import llama
from flexgen_helm.models.tokenizer import gguf_tokenizer
from flexgen_helm.weights.source import WeightSource, rename

GGUF_NAMES = {
    "embed.tokens": "token_embd",
    "layers.{i}.attn_norm": "blk.{i}.attn_norm",
    "layers.{i}.q_proj": "blk.{i}.attn_q",
    "layers.{i}.k_proj": "blk.{i}.attn_k",
    "layers.{i}.v_proj": "blk.{i}.attn_v",
    "layers.{i}.o_proj": "blk.{i}.attn_output",
    "layers.{i}.mlp_norm": "blk.{i}.ffn_norm",
    "layers.{i}.gate_proj": "blk.{i}.ffn_gate",
    "layers.{i}.up_proj": "blk.{i}.ffn_up",
    "layers.{i}.down_proj": "blk.{i}.ffn_down",
    "head.norm": "output_norm",
    "head.lm_head": "output",
}
# GGUF architecture -> transformers model_type. Only "llama" files carry the Q/K permutation
# (Mistral files are written as "llama"; Qwen2's converter leaves rows alone).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
_PERMUTED = {"llama"}
_REQUIRED = object()


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, 2) -> (2, pair)."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile(WeightSource):
    def __init__(self, path: str | Path, name: str | None = None):
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"{self.path}: no such GGUF file")
        try:
            self._reader = GGUFReader(self.path)
        except Exception as e:
            raise WeightStoreError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.arch = self._meta("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ModelNotFoundError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        self.config = llama.config_from_hf(self._hf_config(), name or self._meta("general.name", self.path.stem))

    def _meta(self, key: str, default=_REQUIRED):
        field = self._reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise WeightStoreError(f"{self.path}: GGUF metadata {key!r} is missing")
            return default
        return field.contents()

    def _hf_config(self) -> dict:
        """The metadata as a transformers config dict, so one function builds Llama configs."""
        a = self.arch
        heads = self._meta(f"{a}.attention.head_count")
        hidden = self._meta(f"{a}.embedding_length")
        scaling = self._meta(f"{a}.rope.scaling.type", None)
        return {
            "model_type": ARCHITECTURES[a],
            # len(field.data) counts the tokens without decoding 50k strings
            "vocab_size": len(self._reader.get_field("tokenizer.ggml.tokens").data),
            "hidden_size": hidden,
            "num_hidden_layers": self._meta(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta(f"{a}.attention.head_count_kv", heads),
            "intermediate_size": self._meta(f"{a}.feed_forward_length"),
            "max_position_embeddings": self._meta(f"{a}.context_length"),
            "head_dim": self._meta(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": self._meta(f"{a}.attention.layer_norm_rms_epsilon"),
            "rope_theta": self._meta(f"{a}.rope.freq_base", 10000.0),
            "rope_scaling": {"rope_type": scaling, "factor": self._meta(f"{a}.rope.scaling.factor", 1.0)}
            if scaling not in (None, "none") else None,
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._meta("tokenizer.ggml.eos_token_id", None),
            "pad_token_id": self._meta("tokenizer.ggml.padding_token_id", None),
        }

    @property
    def identity(self) -> str:
        st = self.path.stat()
        return f"gguf:{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"

    def read(self, store_name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        name = rename(store_name, GGUF_NAMES)
        t = self._tensors.get(name)
        if t is None:
            raise WeightStoreError(f"{self.path}: tensor {name!r} (store name {store_name}) is missing")
        a = dequantize(t.data, t.tensor_type)
        # Unquantized types come back as read-only views of the memory-mapped file.
        a = np.ascontiguousarray(a) if a.flags.writeable else a.copy()
        w = torch.from_numpy(a)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if self.arch in _PERMUTED and name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = self.config.num_heads if name.split(".")[-2] == "attn_q" else self.config.num_kv_heads
            w = unpermute_rows(w, heads)
        return w

    def load_tokenizer(self, cache_dir: Path):
        return gguf_tokenizer(self.path, cache_dir)
