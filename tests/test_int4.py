"""4-bit weights on torch's int4 kernels: the kernel path computes what dequantize-then-matmul
computes on the same packed weights (to bf16 rounding), the engine and its disk store use
the packed layout where the settings allow and say why once where they do not, and
impossible settings are refused before any weight is read."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from conftest import save_tiny

from flexgen_helm.compression import int4
from flexgen_helm.compression.int4 import (
    MAX_KERNEL_ROWS,
    CompressedWeight,
    PackedInt4,
    dequantize_packed,
    layout_refusal,
    pack_int4,
)
from flexgen_helm.compression.quantize import dequantize, quantize
from flexgen_helm.compression.stored import weight_layout
from flexgen_helm.engine import Engine
from flexgen_helm.errors import PolicyError
from flexgen_helm.executor import schedule as schedule_module
from flexgen_helm.executor import working_set
from flexgen_helm.executor.sampling import SamplingParams
from flexgen_helm.models import family_of
from flexgen_helm.policy import Policy, Split
from flexgen_helm.policy.policy import Compression
from flexgen_helm.weights import store as store_module
from flexgen_helm.weights.compressed_store import FORMAT_VERSION, CompressedStore, store_layout
from flexgen_helm.weights.registry import resolve

CPU = torch.device("cpu")
BF16 = dict(dtype="bfloat16", device="cpu", progress=False)
# (out, in) of the linears of OPT-1.3B's block and head slice, and of SmolLM2-135M's (llama)
SHAPES = {"opt": [(2048, 2048), (8192, 2048), (2048, 8192)], "llama": [(576, 576), (192, 576), (576, 1536)]}


def _weight(shape, group_size=64, seed=0) -> CompressedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).to(torch.bfloat16)
    q = quantize(w, Compression(4, group_size, 1), 1)
    return CompressedWeight([(0, pack_int4(q, CPU))], shape, torch.bfloat16, MAX_KERNEL_ROWS["cpu"])


def _assert_bf16_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None):
    """|got - x @ w.T| within bf16 rounding of the products' magnitudes (2^-8 relative)."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    assert ((got.double() - exact).abs() <= 2 ** -8 * bound + 1e-6).all()


@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 4, MAX_KERNEL_ROWS["cpu"]], ids=lambda r: f"rows{r}")
def test_kernel_equals_dequantize_then_matmul(family, rows):
    for i, shape in enumerate(SHAPES[family]):
        cw = _weight(shape, seed=i)
        x = torch.randn(2, rows, shape[1], dtype=torch.bfloat16)
        bias = torch.randn(shape[0], dtype=torch.bfloat16)
        assert cw.uses_kernel(2 * rows) == (2 * rows <= MAX_KERNEL_ROWS["cpu"])
        cw.max_kernel_rows = None  # the kernel, whatever the row count
        got = cw.linear(x, bias)
        assert got.shape == (2, rows, shape[0]) and got.dtype == torch.bfloat16
        w = cw.dense()
        _assert_bf16_close(got.reshape(-1, shape[0]), x.reshape(-1, shape[1]), w, bias)
        # torch's own bf16 matmul keeps to the same bound (a few rows: where bf16 matmuls are
        # emulated, all of them take 30 s at OPT's shapes)
        ref = torch.nn.functional.linear(x[:, :2], w, bias).reshape(-1, shape[0])
        _assert_bf16_close(ref, x[:, :2].reshape(-1, shape[1]), w, bias)


def test_prefill_rows_above_the_crossover_take_the_dense_copy_once():
    cw = _weight((256, 512))
    x = torch.randn(MAX_KERNEL_ROWS["cpu"] + 1, 512, dtype=torch.bfloat16)
    assert not cw.uses_kernel(x.shape[0])
    got = cw.linear(x)
    dense = cw.dense()
    assert cw.dense() is dense  # dequantized once per use of the loaded layer
    assert torch.equal(got, torch.nn.functional.linear(x, dense))
    cw.max_kernel_rows = None
    _assert_bf16_close(cw.linear(x), x, dense)


def test_dequantized_packed_weight_is_the_quantized_one():
    """Decoding the kernel's layout gives back the codes: the weight equals the group
    quantization's up to the bf16 rounding of zero = min + 8 * scale."""
    for n in (64, 128 + 16, 64 + 48, 16, 96):
        q = quantize(torch.randn(n, 256).to(torch.bfloat16), Compression(4, 32, 1), 1)
        p = pack_int4(q, CPU)
        want = dequantize(q, torch.float32)
        got = dequantize_packed(p, torch.float32)
        zero = (q.min.float() + 8 * q.scale.float()).repeat_interleave(32, 1)
        assert ((got - want).abs() <= zero.abs() * 2 ** -8 + want.abs() * 2 ** -8).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_dense_copy_rounds_the_float32_weight_once(dtype):
    """Dequantizing into a 16-bit dtype gives the float32 weight rounded once, in either
    orientation and for looked-up rows: a 16-bit affine step that rounded its product and
    its sum apart would move weights by a unit of the last place."""
    p = _weight((256 + 48, 512)).parts[0][1]  # whole blocks and a tail
    exact = dequantize_packed(p, torch.float32)
    for by_column in (True, False):
        assert torch.equal(dequantize_packed(p, dtype, by_column), exact.to(dtype))
    ids = torch.tensor([[0, 300], [64, 17]])
    assert torch.equal(int4.packed_rows_of(p, ids, dtype), exact[ids].to(dtype))


@pytest.mark.parametrize("n", [256, 256 + 48], ids=["blocks", "tail"])
def test_embedding_lookup_dequantizes_only_its_rows(n, monkeypatch):
    """A vocabulary-sized table is looked up a few rows at a time (every decode step): the
    rows come straight from the packed bytes, equal to the dense weight's rows."""
    cw = _weight((n, 128))
    want = dequantize_packed(cw.parts[0][1])
    ids = torch.tensor([[0, 5, n - 1], [31, 32, 64], [200, 255, 2]])
    whole = CompressedWeight([(0, cw.parts[0][1].narrow(0, 0, 64)), (64, cw.parts[0][1].narrow(0, 64, n - 64))],
                             (n, 128), torch.bfloat16, None)
    monkeypatch.setattr(int4, "dequantize_packed", lambda *a: pytest.fail("the whole table was dequantized"))
    for w in (cw, whole):
        got = w.embedding(ids)
        assert got.shape == (3, 3, 128) and torch.equal(got, want[ids])


def test_a_calls_dense_copy_is_made_by_column_at_any_row_count_with_the_same_values():
    """Made for a call, the dense copy is the transpose of an (in, out) matrix (quickest to
    decode; by row never paid back its transposing pass, even over thousands of rows); a copy
    asked for by row (kept for many calls) is a plain (out, in) one with the same values."""
    p = _weight((256 + 48, 128)).parts[0][1]  # whole blocks and a tail
    by_column, by_row = dequantize_packed(p, by_column=True), dequantize_packed(p, by_column=False)
    assert by_column.t().is_contiguous() and by_row.is_contiguous() and torch.equal(by_column, by_row)
    cut = [(0, p.narrow(0, 0, 64)), (64, p.narrow(0, 64, 240))]
    for parts in ([(0, p)], cut):
        for rows in (300, 4096):
            cw = CompressedWeight(parts, p.shape, torch.bfloat16, 0)
            x = torch.randn(rows, 128, dtype=torch.bfloat16)
            assert torch.equal(cw.linear(x), torch.nn.functional.linear(x, by_column))
            assert cw.dense().t().is_contiguous() and torch.equal(cw.dense(), by_row)
        kept = CompressedWeight(parts, p.shape, torch.bfloat16, 0).dense(by_column=False)
        assert kept.is_contiguous() and torch.equal(kept, by_row)


def test_segments_cut_on_blocks_are_packed_matrices_of_their_own():
    q = quantize(torch.randn(160, 128).to(torch.bfloat16), Compression(4, 64, 1), 1)
    whole = pack_int4(q, CPU)
    parts = [(0, whole.narrow(0, 0, 64)), (64, whole.narrow(0, 64, 96))]
    assert torch.equal(parts[1][1].packed, pack_int4(q.narrow(0, 64, 96), CPU).packed)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    one = CompressedWeight([(0, whole)], (160, 128), torch.bfloat16, None)
    split = CompressedWeight(parts, (160, 128), torch.bfloat16, None)
    assert torch.equal(split.linear(x), one.linear(x)) and torch.equal(split.dense(), one.dense())
    with pytest.raises(ValueError, match="blocks of 64"):
        whole.narrow(0, 32, 64)


@pytest.mark.parametrize("cfg, shape, reason", [
    (Compression(4, 64, 1), (100, 256), "out % 16"),  # N not a multiple of the kernel's tile
    (Compression(4, 64, 0), (256, 256), "dim 0"),
    (Compression(3, 64, 1), (256, 256), "3-bit"),
    (Compression(4, 16, 1), (256, 256), "group size 16"),
])
def test_settings_the_kernel_cannot_take_use_the_group_layout(cfg, shape, reason):
    gd = cfg.group_dim
    assert reason in layout_refusal(cfg, shape, gd)
    assert weight_layout(cfg, shape, torch.bfloat16, CPU) is None


def test_slow_path_is_logged_once_per_reason(caplog, monkeypatch):
    monkeypatch.setattr(int4, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="flexgen_helm.compression.int4"):
        for _ in range(3):
            assert weight_layout(Compression(4, 64), (256, 256), torch.float32, CPU) is None
        assert weight_layout(Compression(4, 64), (256, 256), torch.bfloat16, CPU) == "cpu"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "float32 compute" in lines[0]


def test_slow_path_line_names_the_weights_bit_width(caplog, monkeypatch):
    """An 8-bit deployment's line must not call its weights 4-bit."""
    monkeypatch.setattr(int4, "_logged", set())
    with caplog.at_level(logging.WARNING, logger="flexgen_helm.compression.int4"):
        assert weight_layout(Compression(8, 64), (256, 256), torch.bfloat16, CPU) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "8-bit weights" in line and "4-bit weights" not in line


# ---- in the engine -------------------------------------------------------------------------

W4 = Compression(4, 32)  # the tiny models' dims (32, 48, 64, 96) take groups of 32 (48: no)


ON_COMPUTE_TIER = Split(1, 0, 0)


def _engine(path, tmp_path, weights=ON_COMPUTE_TIER, cfg=W4, **kw):
    policy = Policy(gpu_batch_size=2, weights=weights, compress_weight=cfg)
    return Engine.load(str(path), policy, offload_dir=tmp_path, **{**BF16, **kw})


def test_engine_computes_on_packed_weights_in_bfloat16(tiny_opt, tmp_path, monkeypatch):
    calls = []
    real = int4._kernel_mm
    monkeypatch.setattr(int4, "_kernel_mm", lambda x, p: calls.append(x.shape[0]) or real(x, p))
    engine = _engine(tiny_opt, tmp_path, weights=Split(0.2, 0.5, 0.3))
    packed = {name for name, h in engine.runtime.homes.items() if h.layout == "cpu"}
    assert "layers.0.fc1.weight" in packed and "layers.0.q_proj.weight" in packed
    assert all(isinstance(p, PackedInt4) for name in packed for p in engine.runtime.homes[name].data if p is not None)
    prompts = [[5, 17, 3, 44], [12, 7, 9, 1]]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=3, ignore_eos=True)).results
    assert calls and max(calls) <= MAX_KERNEL_ROWS["cpu"]  # decode rows ran on the kernel
    # the same weights, dequantized, give the same tokens' logprobs to bf16 rounding
    monkeypatch.setattr(int4, "MAX_KERNEL_ROWS", {"cpu": 0})
    calls.clear()
    texts = [p + r.completions[0].token_ids for p, r in zip(prompts, out)]
    dense = [r.logprobs[1:] for r in engine.score(texts, as_decode=True).results]
    assert not calls
    for r, want in zip(out, dense):
        assert r.completions[0].logprobs == pytest.approx(want[-3:], abs=0.05)


def test_a_4bit_block_keeps_a_layers_dense_copy_for_the_next(tiny_opt, tmp_path, monkeypatch):
    """Freed memory the schedule keeps for reuse counts the dense copy each layer of a
    compressed prefill makes and frees (else every check handed it back and the next layer
    faulted it in again), and the dequantization's working copies."""
    keeps = []
    monkeypatch.setattr(schedule_module, "freed_beyond", lambda keep: keeps.append(keep) or False)
    monkeypatch.setattr(schedule_module, "RELEASE_CHECK_S", 0.0)
    prompts = [[5, 17, 3, 44], [12, 7, 9, 1]]
    for cfg in (None, W4):
        _engine(tiny_opt, tmp_path, cfg=cfg).generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    plain, packed = keeps[0], keeps[-1]
    config = resolve(str(tiny_opt)).config
    block = next(layer for layer in family_of(config).layer_specs(config) if layer.kind == "block")
    dense = sum(t.numel for t in block.tensors if len(t.shape) == 2) * 2  # bfloat16
    assert packed - plain == 2 * (dense + working_set.DEQUANTIZE_WORKING_BYTES)


def test_a_slow_look_at_freed_memory_makes_the_next_one_later(tiny_opt, tmp_path, monkeypatch):
    """A look at the freed memory kept resident may cost milliseconds (malloc walks its free
    lists): the schedule spends at most RELEASE_CHECK_SHARE of its time on them."""
    looks = []

    def slow_look(keep):
        looks.append(keep)
        time.sleep(0.02)  # next look no sooner than 0.02 / RELEASE_CHECK_SHARE = 2 s later
        return False

    monkeypatch.setattr(schedule_module, "freed_beyond", slow_look)
    monkeypatch.setattr(schedule_module, "RELEASE_CHECK_S", 0.0)
    _engine(tiny_opt, tmp_path, cfg=None).generate([[5, 17, 3, 44]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(looks) == 1


def test_a_slow_hand_back_does_not_put_the_next_look_off(tiny_opt, tmp_path, monkeypatch):
    """Only a look's own time spaces the looks out: a hand-back that takes long (malloc_trim of
    a fragmented heap, ~0.1 s) is work the memory bound needs, and counting it had put the next
    look ~10 s away while a prefill's freed memory grew past what the schedule keeps."""
    looks, hand_backs = [], []

    def slow_hand_back():
        hand_backs.append(1)
        time.sleep(0.02)
        return True

    monkeypatch.setattr(schedule_module, "freed_beyond", lambda keep: looks.append(keep) or True)
    monkeypatch.setattr(schedule_module, "hand_back_freed_memory", slow_hand_back)
    monkeypatch.setattr(schedule_module, "RELEASE_CHECK_S", 0.0)
    _engine(tiny_opt, tmp_path, cfg=None).generate([[5, 17, 3, 44]], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(looks) > 1 and len(hand_backs) == len(looks)


def test_disk_store_holds_packed_bytes_and_rebuilds_an_old_format(tiny_opt, tmp_path):
    engine = _engine(tiny_opt, tmp_path, weights=Split(0, 0, 1))
    store = engine.runtime.store
    layout = store_layout(torch.bfloat16, torch.device("cpu"))  # int4cpu, or int4cpu32 on an AVX2 CPU
    assert isinstance(store, CompressedStore) and store.store.root.name.endswith("-" + layout)
    assert store.compressed["layers.0.fc1.weight"][2] == "cpu"
    read = store.read("layers.0.fc1.weight", (0, 64))
    assert isinstance(read, PackedInt4) and read.scales_zeros.is_contiguous()
    q = quantize(_full(tiny_opt, "layers.0.fc1.weight"), W4, 1)
    assert torch.equal(read.packed, pack_int4(q, CPU).packed)
    assert engine.runtime.homes["layers.0.fc1.weight"].layout == "cpu"
    manifest = store.store.root / "manifest.json"
    m = json.loads(manifest.read_text())
    m["compressed_format"] = 1
    manifest.write_text(json.dumps(m))
    again = _engine(tiny_opt, tmp_path, weights=Split(0, 0, 1))
    assert json.loads(manifest.read_text())["compressed_format"] == FORMAT_VERSION  # rebuilt, not misread
    assert torch.equal(again.runtime.store.read("layers.0.fc1.weight", (0, 64)).packed, read.packed)


def test_a_packed_weight_read_from_disk_is_used_as_it_lands(tmp_path, monkeypatch):
    """The store holds the kernel's layout: a weight read whole is two reads whose buffers
    the kernel takes as they are (no transpose or copy after the read), and the rows of a
    cut weight read (one read per part) equal the same rows of the whole."""
    # fc1: 192 rows (cut at 64 or 128) of 64 inputs: two groups of 32, so the layouts differ
    path = save_tiny("opt", tmp_path / "opt-wider", hidden_size=64, word_embed_proj_dim=64, ffn_dim=192)
    store = _engine(path, tmp_path, weights=Split(0, 0, 1)).runtime.store
    landed = []
    real = store_module.read_bytes

    def spy(*args, **kwargs):
        data = real(*args, **kwargs)
        landed.append(torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0))
        return data

    monkeypatch.setattr(store_module, "read_bytes", spy)
    name = "layers.0.fc1.weight"
    n = store.compressed[name][0][0]
    whole = store.read(name, (0, n))
    assert len(landed) == 2
    for part in (whole.packed, whole.scales_zeros):
        assert any(b.data_ptr() <= part.data_ptr() and part.data_ptr() + part.nbytes <= b.data_ptr() + b.numel()
                   for b in landed), "a read was copied before the kernel could use it"
    assert whole.scales_zeros.is_contiguous() and whole.scales_zeros.shape == (whole.shape[1] // 32, n, 2)
    landed.clear()
    cut = store.read(name, (64, n))
    assert len(landed) == 2
    want = whole.narrow(0, 64, n - 64)
    assert torch.equal(cut.packed, want.packed) and torch.equal(cut.scales_zeros, want.scales_zeros)
    x = torch.randn(3, whole.shape[1], dtype=torch.bfloat16)
    assert torch.equal(int4._kernel_mm(x, cut), int4._kernel_mm(x, whole)[:, 64:])


def _full(path, name):
    return resolve(str(path)).source.read(name).to(torch.bfloat16)


@pytest.mark.parametrize("cfg, match", [
    (Compression(4, 24), "group size 24 does not divide dim 1"),
    (Compression(4, 7, group_dim=0), "group size 7 does not divide dim 0"),
])
def test_impossible_settings_fail_before_loading(tiny_opt, tmp_path, cfg, match, monkeypatch):
    monkeypatch.setattr("flexgen_helm.engine.open_weights",
                        lambda *a, **k: pytest.fail("weights were opened before the settings were checked"))
    with pytest.raises(PolicyError, match=match):
        _engine(tiny_opt, tmp_path, cfg=cfg)


@pytest.mark.parametrize("bits", [1, 9])
def test_bits_outside_2_to_8_are_refused(bits):
    with pytest.raises(PolicyError, match=f"{bits} bits is outside the supported 2..8"):
        Policy(compress_weight=Compression(bits, 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 4, 64])
def test_cuda_kernel_equals_dequantize_then_matmul(family, rows):
    cuda = torch.device("cuda")
    for i, shape in enumerate(SHAPES[family]):
        q = quantize(torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16),
                     Compression(4, 64, 1), 1)
        p = pack_int4(q, cuda)
        back = p.to("cpu").to(cuda)  # a tier round trip moves plain bytes
        cw = CompressedWeight([(0, back)], shape, torch.bfloat16, None)
        x = torch.randn(rows, shape[1], dtype=torch.bfloat16, device=cuda)
        w = cw.dense()
        want = dequantize(q, torch.float32).to(cuda)
        zero = (q.min.float() + 8 * q.scale.float()).repeat_interleave(64, 1).to(cuda)
        assert ((w.float() - want).abs() <= (zero.abs() + want.abs()) * 2 ** -7).all()
        _assert_bf16_close(cw.linear(x).cpu(), x.cpu(), w.cpu())
