"""Shared fixtures: tiny random checkpoints written with transformers, the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flexgen_helm.models.tokenizer import byte_standin_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _transformers():
    from flexgen_helm.models.tokenizer import import_transformers

    return import_transformers()


def save_tiny(kind: str, path: Path, **overrides) -> Path:
    """A small random checkpoint of an architecture, saved as safetensors."""
    tf = _transformers()
    torch.manual_seed(0)
    if kind == "opt":
        cfg = tf.OPTConfig(**{**dict(vocab_size=300, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32), **overrides})
        model = tf.OPTForCausalLM(cfg)
    elif kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=300, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                             rope_theta=50000.0, **overrides)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                             num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64, **overrides)
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.save_pretrained(path, safe_serialization=True)
    # a byte-level tokenizer, so that text prompts and completions work too
    byte_standin_tokenizer(SimpleNamespace(vocab_size=cfg.vocab_size, name=kind)).save_pretrained(path)
    return path


def hf_model(path: Path):
    return _transformers().AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory) -> Path:
    return save_tiny("opt", tmp_path_factory.mktemp("tiny-opt"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Stores converted by tests live in a per-session cache, not the user's."""
    cache = tmp_path_factory.getbasetemp() / "flexgen-cache"
    monkeypatch.setenv("FLEXGEN_HELM_CACHE", str(cache))
    monkeypatch.setenv("FLEXGEN_HELM_OFFLOAD", str(tmp_path_factory.getbasetemp() / "offload"))


@pytest.fixture
def small_fs(tmp_path):
    """make(nbytes) -> a folder on a new file system of that size (a tmpfs), for full-disk
    tests; they are skipped, with the reason, where this machine cannot mount one."""
    import subprocess

    mounted = []

    def make(nbytes: int) -> Path:
        where = tmp_path / f"small-fs-{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN): "
                        f"{proc.stderr.strip() or proc.returncode}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
