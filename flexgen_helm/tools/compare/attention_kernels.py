"""Causal prompt attention on this machine: the engine's path (executor.attention.attend;
in bfloat16 on the CPU, query blocks as bf16 matmuls over smoothed keys) against the
alternatives it was chosen from, at a model's head shapes and several lengths.

    python -m flexgen_helm.tools.compare.attention_kernels --lengths 512 2048 8192

Candidates: torch's fused SDPA with is_causal (GQA as expanded views, or enable_gqa),
torch.nn.attention.flex_attention with a causal block mask (eager, and compiled), and three
blocked versions written with plain ops (query blocks attending only to the keys up to
their end, bf16 matmuls, softmax in float32): in one pass per block; over key blocks with
a running softmax; with a kv head's query heads stacked as the rows of 2-D matmuls and the
mask on the diagonal tile only (--parts times its steps). With --padded, every batch row
has its own length (left padding): the engine's rotation (one causal call) against the
paths it replaced (a dense mask; one call per length).

Timings are rounds of every candidate back to back, the ratio to SDPA taken within a round,
the median over rounds reported: on a shared machine only such ratios mean anything."""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from flexgen_helm.executor.attention import attend


def sdpa(q, k, v, valid):
    u, r, t, d = q.shape
    return F.scaled_dot_product_attention(q, k[:, None].expand(u, r, t, d), v[:, None].expand(u, r, t, d),
                                          is_causal=True)


def sdpa_gqa(q, k, v, valid):
    return F.scaled_dot_product_attention(q, k[:, None], v[:, None], is_causal=True, enable_gqa=True)


def _allowed(valid, i0: int, i1: int, j0: int, j1: int):
    """(u, 1, i1 - i0, j1 - j0): which of keys j0..j1 queries i0..i1 may see (valid, causal)."""
    return valid[:, None, None, j0:j1] & (torch.arange(j0, j1) <= torch.arange(i0, i1)[:, None])


def blocked(q, k, v, valid, block: int = 256):
    """Per query block, one bf16 matmul against the keys up to its end, softmax in float32."""
    u, r, t, d = q.shape
    out = torch.empty_like(q)
    qs = q * (1 / math.sqrt(d))
    for i0 in range(0, t, block):
        i1 = min(i0 + block, t)
        s = torch.matmul(qs[:, :, i0:i1], k[:, None, :i1].transpose(-1, -2)).float()  # (u, r, i1 - i0, i1)
        p = s.masked_fill_(~_allowed(valid, i0, i1, 0, i1), -math.inf).softmax(-1).nan_to_num_(0.0).to(q.dtype)
        out[:, :, i0:i1] = torch.matmul(p, v[:, None, :i1])
    return out


def blocked_online(q, k, v, valid, block: int = 256):
    """Query blocks x key blocks up to the diagonal, with a running max and sum."""
    u, r, t, d = q.shape
    out = torch.empty_like(q)
    qs = q * (1 / math.sqrt(d))
    for i0 in range(0, t, block):
        i1 = min(i0 + block, t)
        qb = qs[:, :, i0:i1]
        m = torch.full((u, r, i1 - i0, 1), -math.inf)
        total = torch.zeros(u, r, i1 - i0, 1)
        acc = torch.zeros(u, r, i1 - i0, d)
        for j0 in range(0, i1, block):
            j1 = min(j0 + block, i1)
            s = torch.matmul(qb, k[:, None, j0:j1].transpose(-1, -2)).float()
            s.masked_fill_(~_allowed(valid, i0, i1, j0, j1), -math.inf)
            new_m = torch.maximum(m, s.amax(-1, keepdim=True))
            safe = new_m.nan_to_num(neginf=0.0)
            p = torch.exp(s - safe)
            scale = torch.exp(m - safe)
            total = total * scale + p.sum(-1, keepdim=True)
            acc = acc * scale + torch.matmul(p.to(q.dtype), v[:, None, j0:j1]).float()
            m = new_m
        out[:, :, i0:i1] = (acc / total.clamp(min=1e-30)).to(q.dtype)
    return out


def blocked_rows(q, k, v, valid, block: int = 64, parts: dict | None = None):
    """Unpadded rows only. Per kv head, query blocks with that head's query heads stacked as
    the rows of one matrix, so a block is two 2-D bf16 matmuls against the keys up to its
    end; the causal mask on the diagonal tile only; softmax in float32. `parts`: seconds per
    step, accumulated (--parts)."""
    if not bool(valid.all()):
        raise ValueError("blocked_rows takes unpadded rows only")
    u, r, t, d = q.shape
    out = torch.empty_like(q)
    qs = q * (1 / math.sqrt(d))
    above = torch.ones(block, block, dtype=torch.bool).triu(1)
    clock = time.perf_counter

    def step(name, t0):
        if parts is not None:
            parts[name] = parts.get(name, 0.0) + clock() - t0
        return clock()

    for a in range(u):
        for i0 in range(0, t, block):
            i1 = min(i0 + block, t)
            n = i1 - i0
            t0 = clock()
            s = torch.mm(qs[a, :, i0:i1].reshape(r * n, d), k[a, :i1].t())
            t0 = step("q @ k^T", t0)
            s = s.float()
            t0 = step("to float32", t0)
            s.view(r, n, i1)[:, :, i0:i1].masked_fill_(above[:n, :n], -math.inf)
            t0 = step("mask", t0)
            m = s.amax(-1, keepdim=True)
            t0 = step("row max", t0)
            s.sub_(m).exp_()
            t0 = step("subtract, exp", t0)
            total = s.sum(-1, keepdim=True)
            t0 = step("row sum", t0)
            p = s.to(q.dtype)
            t0 = step("to bf16", t0)
            o = torch.mm(p, v[a, :i1])
            t0 = step("p @ v", t0)
            out[a, :, i0:i1] = (o.float() / total).to(q.dtype).view(r, n, d)
            step("normalize", t0)
    return out


def masked(q, k, v, valid):
    """The former path for small padded batches: SDPA with a dense (q, t) mask."""
    u, r, t, d = q.shape
    pos = torch.arange(t)
    allowed = (valid[:, None, :] & (pos[None, :] <= pos[:, None])) | torch.eye(t, dtype=torch.bool)
    return F.scaled_dot_product_attention(q, k[:, None].expand(u, r, t, d), v[:, None].expand(u, r, t, d),
                                          attn_mask=allowed[:, None])


def per_length(q, k, v, valid):
    """The former path for long padded batches: one causal SDPA call per distinct length."""
    u, r, t, d = q.shape
    lengths = valid.sum(-1)
    out = v[:, None].expand(u, r, t, d).clone()
    for n in lengths.unique().tolist():
        units = (lengths == n).nonzero().squeeze(1)
        out[units, :, t - n:] = sdpa(q[units, :, t - n:], k[units, t - n:], v[units, t - n:], None)
    return out


def engine(q, k, v, valid):
    return attend(q, k, v, valid, causal=True)


def flex_candidates(t: int, valid: torch.Tensor, eager_up_to: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    start = (~valid).sum(-1)  # each unit's first real position

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (ki >= start[b])

    block_mask = create_block_mask(mask_mod, valid.shape[0], None, t, t, device="cpu")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(fn):
        return lambda q, k, v, valid_: fn(q, k[:, None], v[:, None], block_mask=block_mask, enable_gqa=True)

    out = {"flex_compiled": run(compiled)}
    if t <= eager_up_to:  # eager flex materialises (t, t) scores: minutes at 8192
        out["flex_eager"] = run(flex_attention)
    return out


def measure(t: int, args) -> list[str]:
    g = torch.Generator().manual_seed(t)
    u, r, d = args.batch * args.kv_heads, args.heads // args.kv_heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    q = torch.randn(u, r, t, d, generator=g).to(dtype)
    # keys sharing a component, as a trained model's do (--key-offset)
    k = (args.key_offset + torch.randn(u, t, d, generator=g)).to(dtype)
    v = torch.randn(u, t, d, generator=g).to(dtype)
    lengths = torch.full((args.batch,), t)
    if args.padded:
        lengths = torch.randint(int(t * args.min_fill), t + 1, (args.batch,), generator=g)
        lengths[0] = t
    valid = (torch.arange(t)[None, :] >= (t - lengths)[:, None]).repeat_interleave(args.kv_heads, 0)
    cands = {"sdpa_causal": sdpa, "engine": engine, "sdpa_enable_gqa": sdpa_gqa, "blocked": blocked,
             "blocked_online": blocked_online, "blocked_rows": blocked_rows}
    if args.padded:
        cands = {"sdpa_causal": sdpa, "engine": engine, "masked (former)": masked,
                 "per_length (former)": per_length, "blocked": blocked}
    if not args.no_flex:
        cands.update(flex_candidates(t, valid, args.flex_eager_up_to))
    # error against float64 per sequence, real positions only
    errors = {}
    for name, fn in cands.items():
        out = fn(q, k, v, valid).double()
        err = 0.0
        for b in range(args.batch):
            n = int(lengths[b])
            rows = slice(b * args.kv_heads, (b + 1) * args.kv_heads)
            ref = sdpa(q[rows, :, t - n:].double(), k[rows, t - n:].double(), v[rows, t - n:].double(), None)
            err = max(err, (out[rows, :, t - n:] - ref).abs().max().item())
        errors[name] = err
    times = {name: [] for name in cands}
    for _ in range(args.rounds):
        for name, fn in cands.items():
            t0 = time.perf_counter()
            fn(q, k, v, valid)
            times[name].append(time.perf_counter() - t0)
    flops = 4 * args.batch * args.heads * d * float(lengths.double().pow(2).sum() / args.batch) / 2
    lines = []
    for name in cands:
        ratio = statistics.median(s / b for s, b in zip(times["sdpa_causal"], times[name]))
        ms = statistics.median(times[name]) * 1e3
        lines.append(f"| {t} | {name} | {ms:.1f} | {ratio:.2f}x | {flops / statistics.median(times[name]) / 1e9:.0f} "
                     f"| {errors[name]:.2e} |")
    if args.parts and not args.padded:
        parts: dict = {}
        blocked_rows(q, k, v, valid, parts=parts)
        lines.append(f"| {t} | blocked_rows, its steps (one more call, ms): "
                     + ", ".join(f"{name} {sec * 1e3:.0f}" for name, sec in parts.items()) + " | | | | |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--padded", action="store_true", help="rows of lengths min_fill*t..t, left padded")
    p.add_argument("--min-fill", type=float, default=0.5, help="with --padded: the shortest row, as a fraction of t")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--key-offset", type=float, default=0.0,
                   help="a component every key shares, added to each coordinate (random keys have none)")
    p.add_argument("--no-flex", action="store_true")
    p.add_argument("--parts", action="store_true", help="time blocked_rows' steps (matmuls, softmax pieces) once more")
    p.add_argument("--flex-eager-up-to", type=int, default=2048)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); on a machine shared with other "
                   "jobs, 1 avoids timing the threads' waits for each other instead of the kernels")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.dtype}, batch {args.batch}, {args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}, "
          f"{'left padded' if args.padded else 'no padding'}, {torch.get_num_threads()} threads; "
          f"speed = SDPA's time / the candidate's, median over {args.rounds} rounds; "
          f"GFLOP/s counts the causal half; error: max abs vs float64, real positions; key offset {args.key_offset}")
    print("| length | candidate | ms | speed vs SDPA | GFLOP/s | error |\n| --- | --- | --- | --- | --- | --- |")
    for t in args.lengths:
        for line in measure(t, args):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
