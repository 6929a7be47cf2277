"""A llama.cpp GGUF file (llama and Mixtral, qwen2, qwen3, gemma2, gemma3, phi3, qwen2moe, qwen3moe,
olmoe): config from its metadata, tensors dequantized to float one at a time (an expert's
rows alone, out of its block's stacked experts), or, quantized ones, their own codes
(weights/gguf_codes.py).

What differs from a Hugging Face checkpoint is undone here: GGUF lists shapes
innermost-first (a Linear weight (out, in) shows as [in, out]); llama.cpp's converter
permutes the rows of the Q and K projections of "llama" models to interleave each head's
rotary pairs (our math, like transformers', rotates halves, so the rows go back); it
stores Gemma's norm weights as 1 + w (the one comes off). Per architecture:
weights/gguf_arch.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from flexgen_helm.compression.quantize import QuantizedTensor
from flexgen_helm.errors import ModelNotFoundError, WeightStoreError
from flexgen_helm.models import FAMILIES, HF_MODEL_TYPES
from flexgen_helm.models.tokenizer import gguf_tokenizer
from flexgen_helm.weights.gguf_arch import ARCHITECTURES
from flexgen_helm.weights.gguf_codes import read_codes
from flexgen_helm.weights.source import WeightSource, rename

_REQUIRED = object()
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: per head, rows (pair, 2) -> (2, pair)."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFFile(WeightSource):
    """Parsing a GGUF's metadata takes seconds (its vocabulary is tens of thousands of
    strings), so the derived config is cached as JSON under `cache_dir` (keyed by path,
    size and mtime) and the file itself is parsed only when a tensor is read."""

    def __init__(self, path: str | Path, name: str | None = None, cache_dir: str | Path | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"{self.path}: no such GGUF file")
        meta = self._cached_meta(Path(cache_dir) if cache_dir else None)
        self._types = meta.get("tensor_types")  # None in a cache written before they were kept
        self.arch = ARCHITECTURES[meta["arch"]]
        hf = meta["hf_config"]
        self.config = FAMILIES[HF_MODEL_TYPES[hf["model_type"]]].config_from_hf(hf, name or meta["name"])

    def _cached_meta(self, cache_dir: Path | None) -> dict:
        key = hashlib.sha256(self.identity.encode()).hexdigest()[:16]
        cached = cache_dir / "gguf-meta" / f"{self.path.stem}-{key}.json" if cache_dir else None
        if cached is not None and cached.is_file():
            return json.loads(cached.read_text())
        arch = self._meta("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelNotFoundError(
                f"{self.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        meta = {"arch": arch, "name": self._meta("general.name", self.path.stem), "hf_config": self._hf_config(arch),
                "tensor_types": {t.name: t.tensor_type.name for t in self._reader.tensors}}
        if cached is not None:
            try:  # beside the final name, then renamed: a reader never sees half a file
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
                tmp.write_text(json.dumps(meta))
                tmp.rename(cached)
            except OSError:
                pass  # a read-only cache: parse again next time
        return meta

    @cached_property
    def _reader(self):
        from gguf import GGUFReader

        try:
            return GGUFReader(self.path)
        # the parser reports a malformed file as whatever it hit (ValueError, struct or numpy
        # errors, OSError): each is named, with the file
        except Exception as e:
            raise WeightStoreError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e

    @cached_property
    def _tensors(self) -> dict:
        return {t.name: t for t in self._reader.tensors}

    def release(self) -> None:
        for mapped in ("_tensors", "_reader"):  # the reader's memory map, and its tensors' views of it
            self.__dict__.pop(mapped, None)

    def _meta(self, key: str, default=_REQUIRED):
        field = self._reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise WeightStoreError(f"{self.path}: GGUF metadata {key!r} is missing")
            return default
        return field.contents()

    def _hf_config(self, a: str) -> dict:
        """The metadata of architecture `a` as a transformers config dict, so that one
        function per family builds configs from either format."""
        heads = self._meta(f"{a}.attention.head_count")
        hidden = self._meta(f"{a}.embedding_length")
        scaling = self._meta(f"{a}.rope.scaling.type", None)
        hf = {
            "model_type": ARCHITECTURES[a].model_type,
            # len(field.data) counts the tokens without decoding 50k strings
            "vocab_size": len(self._reader.get_field("tokenizer.ggml.tokens").data),
            "hidden_size": hidden,
            "num_hidden_layers": self._meta(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta(f"{a}.attention.head_count_kv", heads),
            "intermediate_size": self._meta(f"{a}.feed_forward_length"),
            "max_position_embeddings": self._meta(f"{a}.context_length"),
            "head_dim": self._meta(f"{a}.attention.key_length", None) or self._head_dim(heads, hidden),
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
        hf.update(ARCHITECTURES[a].extra(lambda key, default: self._meta(f"{a}.{key}", default), hf))
        if self._meta(f"{a}.expert_count", 0):  # blocks without a router keep a dense MLP (Qwen's mlp_only_layers)
            hf["mlp_only_layers"] = [i for i in range(hf["num_hidden_layers"])
                                     if f"blk.{i}.ffn_gate_inp.weight" not in self._tensors]
        if "rope_factors_long.weight" in self._tensors:  # Phi-3's LongRoPE: the factors are tensors
            hf["rope_scaling"] = {"rope_type": "longrope", "long_factor": self._factors("long"),
                                  "short_factor": self._factors("short"),
                                  "attention_factor": self._meta(f"{a}.rope.scaling.attn_factor", None)}
        return hf

    def _head_dim(self, heads: int, hidden: int) -> int:
        """Where key_length is not written: from the query projection's width (Qwen3's heads
        are wider than hidden / heads)."""
        q = self._tensors.get("blk.0.attn_q.weight")
        return int(q.shape[1]) // heads if q is not None else hidden // heads

    def _factors(self, kind: str) -> list[float]:
        t = self._tensors[f"rope_factors_{kind}.weight"]
        return [float(x) for x in np.asarray(t.data, dtype=np.float64).reshape(-1)]

    @property
    def identity(self) -> str:
        st = self.path.stat()
        return f"gguf:{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"

    def tensor_type(self, store_name: str) -> str:
        """The GGUF type the file stores a tensor in ("Q4_1", "F32", ...)."""
        name = rename(store_name, self.arch.names)
        types = self._types if self._types is not None else {t.name: t.tensor_type.name for t in self._reader.tensors}
        if name not in types:
            raise WeightStoreError(f"{self.path}: tensor {name!r} (store name {store_name}) is missing")
        return types[name]

    def read_codes(self, store_name: str) -> QuantizedTensor:
        """A quantized (out, in) tensor's own codes, scales and minimums (weights/gguf_codes.py),
        with the rows put back as `read` puts them: equal to `read` once dequantized."""
        name = rename(store_name, self.arch.names)
        t, data, shape = self._stored(name, store_name)
        if len(shape) != 2:
            raise WeightStoreError(f"{self.path}: {name} is {len(shape)}-D; only (out, in) weights have codes here")
        q = read_codes(data, t.tensor_type.name, shape)
        kind = name.split(".")[-2]
        if self.arch.permuted and kind in ("attn_q", "attn_k"):
            heads = self.config.num_heads if kind == "attn_q" else self.config.num_kv_heads
            q = dataclasses.replace(q, **{p: unpermute_rows(getattr(q, p), heads).contiguous()
                                          for p in ("data", "scale", "min")})
        return q

    def _stored(self, name: str, store_name: str):
        """The file's tensor, and the part of its data the store tensor is with that part's
        (out, in) shape: an expert's rows alone, out of its block's stacked (experts, out, in) one."""
        t = self._tensors.get(name)
        if t is None:
            raise WeightStoreError(f"{self.path}: tensor {name!r} (store name {store_name}) is missing")
        shape = tuple(int(d) for d in reversed(t.shape))
        data = t.data
        expert = _EXPERT.search(store_name)
        if expert:
            data, shape = data[int(expert[1])], shape[1:]
        return t, data, shape

    def read(self, store_name: str) -> torch.Tensor:
        from gguf.quants import dequantize

        name = rename(store_name, self.arch.names)
        t, data, shape = self._stored(name, store_name)
        a = dequantize(data, t.tensor_type)
        # Unquantized types come back as read-only views of the memory-mapped file.
        a = np.ascontiguousarray(a) if a.flags.writeable else a.copy()
        w = torch.from_numpy(a)
        w = w.reshape(shape)
        kind = name.split(".")[-2]
        if self.arch.permuted and kind in ("attn_q", "attn_k"):
            w = unpermute_rows(w, self.config.num_heads if kind == "attn_q" else self.config.num_kv_heads)
        if self.arch.norm_offset and kind.endswith("norm"):
            w = w - self.arch.norm_offset
        if kind == "ffn_gate_inp_shexp":  # llama.cpp's is one row, written (hidden,) or (1, hidden)
            w = w.reshape(1, -1)
        return w

    def load_tokenizer(self, cache_dir: Path):
        return gguf_tokenizer(self.path, cache_dir)
