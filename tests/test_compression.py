"""Group-wise quantization: packing round trips, the scale/2 error bound, storage size."""

import sys

import pytest
import torch

from flexgen_helm.compression import (
    QuantizedTensor,
    codes_of,
    default_cache_group_dim,
    default_weight_group_dim,
    dequantize,
    fake_quantize,
    pack,
    quantize,
    should_compress,
    unpack,
)
from flexgen_helm.errors import PolicyError
from flexgen_helm.policy.policy import Compression

BITS = range(2, 9)


def _expand_groups(t: torch.Tensor, q: QuantizedTensor) -> torch.Tensor:
    """Per-group values (scale or min) repeated to the original shape."""
    gd = q.group_dim
    return t.repeat_interleave(q.group_size, dim=gd).narrow(gd, 0, q.shape[gd])


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("G", [1, 3, 8, 13, 64])
def test_pack_unpack_round_trip(bits, G):
    gen = torch.Generator().manual_seed(bits * 100 + G)
    codes = torch.randint(0, 1 << bits, (5, 2, G), generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2, -(-G * bits // 8))
    assert torch.equal(unpack(packed, bits, G), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_fast_path_is_the_bitstream(bits):
    # The layout is one little-endian bitstream for every width; check a known value.
    codes = (torch.arange(16) * 37 % (1 << bits)).to(torch.uint8)
    packed = pack(codes, bits)
    stream = "".join(format(int(c), f"0{bits}b")[::-1] for c in codes)  # LSB first
    expect = [int(stream[i : i + 8][::-1], 2) for i in range(0, len(stream), 8)]
    assert packed.tolist() == expect


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_dim", [0, 1])
def test_dequantize_is_min_plus_code_times_scale(bits, dtype, group_dim):
    x = torch.randn(70, 50, generator=torch.Generator().manual_seed(bits)).to(dtype)
    q = quantize(x, Compression(bits, 16), group_dim)
    codes = codes_of(q)
    assert codes.shape == x.shape and int(codes.max()) <= (1 << bits) - 1
    mn, sc = _expand_groups(q.min, q).float(), _expand_groups(q.scale, q).float()
    expect = mn + codes.float() * sc
    assert torch.equal(dequantize(q, torch.float32), expect)
    assert torch.equal(dequantize(q), expect.to(dtype))
    assert dequantize(q).dtype == dtype and q.scale.dtype == dtype and q.min.dtype == dtype


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("G", [4, 7, 32, 64])
@pytest.mark.parametrize("group_dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_error_bound(bits, G, group_dim, dtype):
    gen = torch.Generator().manual_seed(17 * bits + G)
    # Columns of very different magnitudes and offsets, rows not a multiple of G.
    x = (torch.randn(100, 3, 37, generator=gen) * torch.logspace(-3, 2, 37) + 5).to(dtype)
    q = quantize(x, Compression(bits, G), group_dim)
    x_hat = dequantize(q, torch.float32)
    err = (x.float() - x_hat).abs()
    bound = _expand_groups(q.scale, q).float() / 2
    assert (err <= bound * (1 + 1e-5) + 1e-7 * x.float().abs()).all()
    # The stored scale is the group's range / (2^bits - 1), only rounded up to the storage dtype.
    lo = _expand_groups(q.min, q).float()
    top = lo + _expand_groups(q.scale.float() * ((1 << bits) - 1), q)
    tol = 1e-6 * (x.float().abs() + top.abs() + lo.abs())  # float rounding of min + L * scale
    assert (x.float() >= lo).all() and (x.float() <= top + tol).all()  # [min, min + L*scale] covers the group
    ideal = (x.float().max() - x.float().min()) / ((1 << bits) - 1)
    assert q.scale.float().max() <= ideal * (1 + torch.finfo(dtype).eps)
    assert torch.equal(fake_quantize(x, Compression(bits, G), group_dim), dequantize(q))


@pytest.mark.parametrize("shape,group_dim", [((203, 37), 0), ((203, 37), 1), ((9, 5, 70), 2), ((150,), 0), ((0, 8), 1)])
@pytest.mark.parametrize("chunk_elements", [1, 100, 1 << 30])
def test_blocks_of_rows_give_the_same_bytes_as_the_whole(shape, group_dim, chunk_elements):
    """quantize and dequantize work on blocks of rows to bound their float32 copies; any
    block size stores and returns exactly what the whole tensor at once does."""
    x = torch.randn(shape, dtype=torch.bfloat16)
    cfg = Compression(4, 16)
    whole = quantize(x, cfg, group_dim, chunk_elements=1 << 30)
    blocked = quantize(x, cfg, group_dim, chunk_elements=chunk_elements)
    assert blocked.shape == whole.shape
    for a, b in zip(whole.parts, blocked.parts):
        assert torch.equal(a, b)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize(whole, dtype, chunk_elements=chunk_elements),
                           dequantize(whole, dtype, chunk_elements=1 << 30))


@pytest.mark.parametrize("shape,group_dim", [((203, 37), 0), ((203, 37), 1), ((9, 5, 70), 2), ((2, 30, 64), 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("method", ["rtn", "hqq"])
def test_fake_quantize_is_dequantize_of_quantize_bit_for_bit(shape, group_dim, dtype, method, monkeypatch):
    """fake_quantize skips packing the codes (a KV cache held dense rounds every write with
    it) and still returns exactly what a compressed tensor dequantizes to: padded groups,
    constant groups, several blocks of rows, per-channel groups."""
    x = torch.randn(shape, dtype=dtype)
    x[1] = 0.25  # constant groups along the last dim
    for cfg in (Compression(4, 16, method=method), Compression(8, 64, method=method),
                Compression(3, -1, method=method)):
        want = dequantize(quantize(x, cfg, group_dim))
        got = fake_quantize(x, cfg, group_dim)
        assert got.dtype == x.dtype and torch.equal(got, want)
    module = sys.modules["flexgen_helm.compression.quantize"]  # (the package's `quantize` is the function)
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 500)
    monkeypatch.setattr(module, "FIT_CHUNK_ELEMENTS", 500)
    cfg = Compression(4, 8, method=method)
    assert torch.equal(fake_quantize(x, cfg, group_dim), dequantize(quantize(x, cfg, group_dim)))


def test_scale_is_range_over_levels():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 15.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    q = quantize(x, Compression(4, 5), 1)
    assert q.scale.tolist() == [[1.0], [0.0]] and q.min.tolist() == [[0.0], [1.0]]
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_constant_groups_are_exact(bits, dtype):
    x = torch.full((64, 10), 3.1415, dtype=dtype)
    x[:, 3] = -0.007
    x[:, 4] = 0.0
    q = quantize(x, Compression(bits, 16), 0)
    assert torch.equal(dequantize(q), x)
    assert (q.scale == 0).all()


def test_padding_does_not_widen_the_range():
    # The last group holds only 1 real element: it must be exact (scale 0), whatever the padding.
    x = torch.randn(65, 4)
    q = quantize(x, Compression(4, 64), 0)
    assert q.scale.shape[0] == 2 and (q.scale[1] == 0).all()  # groups along dim 0
    assert torch.equal(dequantize(q)[64], x[64])


def test_nbytes_4_bits():
    x = torch.randn(256, 96, dtype=torch.float16)
    q = quantize(x, Compression(4, 64), 0)
    groups = (256 // 64) * 96
    assert q.nbytes == x.numel() // 2 + groups * 2 * 2  # half a byte per value + fp16 scale, min
    assert q.data.numel() == x.numel() // 2
    # Group size not dividing the dim: the padded last group is stored too.
    q = quantize(torch.randn(100, 96, dtype=torch.float16), Compression(4, 64), 0)
    assert q.nbytes == 2 * 64 * 96 // 2 + 2 * 96 * 4


@pytest.mark.parametrize("bits", BITS)
def test_nbytes_is_honest_for_every_width(bits):
    x = torch.randn(4, 128)
    q = quantize(x, Compression(bits, 64), 1)
    assert q.data.numel() == x.numel() * bits // 8  # no code stored wider than `bits`
    assert q.nbytes == q.data.numel() + 2 * 4 * 2 * 4  # fp32 scale and min per group


def test_default_group_dims_and_what_is_compressed():
    assert should_compress((4, 8)) and should_compress((2, 3, 4))
    assert not should_compress((8,))
    assert default_weight_group_dim((4096, 1024)) == 1
    assert default_cache_group_dim() == 2
    with pytest.raises(ValueError):
        default_weight_group_dim((8,))
    # A 1-D tensor can still be quantized explicitly if a caller insists.
    v = torch.randn(100)
    assert dequantize(quantize(v, Compression(8, 64), 0)).shape == (100,)


def test_kv_cache_layout_groups_per_token():
    # (max_len, units, head_dim), groups along head_dim: each token's row stands alone, so
    # quantizing a prefix equals the prefix of the whole quantized cache.
    cache = torch.randn(12, 6, 64, dtype=torch.float16)
    cfg = Compression(4, 32)
    full = quantize(cache, cfg, default_cache_group_dim())
    part = quantize(cache[:5], cfg, default_cache_group_dim())
    assert torch.equal(full.data[:5], part.data) and torch.equal(dequantize(full)[:5], dequantize(part))
    assert torch.equal(dequantize(full.narrow(0, 5, 4)), dequantize(full)[5:9])


def test_narrow_along_and_across_groups():
    x = torch.randn(100, 30)
    q = quantize(x, Compression(3, 16), 0)
    full = dequantize(q)
    assert torch.equal(dequantize(q.narrow(0, 32, 48)), full[32:80])
    assert torch.equal(dequantize(q.narrow(0, 96, 4)), full[96:])
    assert torch.equal(dequantize(q.narrow(1, 7, 9)), full[:, 7:16])
    with pytest.raises(ValueError):
        q.narrow(0, 8, 16)


def test_to_device_and_validation():
    x = torch.randn(64, 8)
    q = quantize(x, Compression(4, 64), 0)
    q2 = q.to("cpu", non_blocking=True)
    assert isinstance(q2, QuantizedTensor) and torch.equal(dequantize(q2), dequantize(q))
    with pytest.raises(PolicyError):
        quantize(x, Compression(9, 64), 0)
    with pytest.raises(TypeError):
        quantize(torch.ones(4, 4, dtype=torch.int32), Compression(4, 2), 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_cpu(bits):
    x = torch.randn(130, 70, dtype=torch.float16)
    cfg = Compression(bits, 64)
    qc, qg = quantize(x, cfg, 0), quantize(x.cuda(), cfg, 0)
    assert torch.equal(qg.data.cpu(), qc.data) and torch.equal(qg.scale.cpu(), qc.scale)
    assert torch.equal(dequantize(qg).cpu(), dequantize(qc))
    assert torch.equal(dequantize(qc.to("cuda")).cpu(), dequantize(qc))


