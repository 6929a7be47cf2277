"""Which grouping a 4-bit KV cache should take, checked outside the engine (issue 22): the
engine's per-token groups (each position's head_dim, RTN or hqq) against KIVI's (Liu et
al., 2024) keys grouped per channel over blocks of tokens and values per token.

transformers' SmolLM2-135M (float32) with an attention function that sees the cache as a
decode step would: a query attends to the earlier keys and values as stored (quantized) and
to the ones still in full precision - its own (per-token schemes), or its whole block of
`--block` tokens, which KIVI keeps unquantized until the block is full (its "residual").
A per-token row with that same full-precision residual separates the residual's share from
the grouping's. WikiText-2 token perplexity of the first `--tokens` tokens, windows of 1024.

    python -m flexgen_helm.tools.accuracy_sweep.kv_grouping   # -> runs/accuracy/json/kv_grouping.json
    python -m flexgen_helm.tools.accuracy_sweep.kv_grouping --key-channels --tokens 1024   # key_channels.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from flexgen_helm.compression.quantize import dequantize, quantize
from flexgen_helm.models.tokenizer import import_transformers
from flexgen_helm.policy.policy import Compression
from flexgen_helm.tools.accuracy_sweep.hf_reference import (
    WINDOW,
    smollm2_model,
    smollm2_tokenizer,
    token_perplexity,
    wikitext_ids,
)
from flexgen_helm.tools.accuracy_sweep.plan import OUT

# name -> (key grouping, key method, full precision: "own" token or its "block")
VARIANTS = {
    "none": None,
    "per-token rtn": ("token", "rtn", "own"),
    "per-token hqq": ("token", "hqq", "own"),
    "per-token rtn + block residual": ("token", "rtn", "block"),
    "KIVI: keys per channel rtn + block residual": ("channel", "rtn", "block"),
}


def _fake(x: torch.Tensor, bits: int, group: int, dim: int, method: str) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) quantized -> dequantized in groups along `dim`."""
    return dequantize(quantize(x, Compression(bits, group, method=method), dim))


def _attention(variant, bits: int, block: int):
    def attend(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        groups = module.num_key_value_groups
        seq, d = key.shape[2], key.shape[3]
        kind, method, residual = variant
        # keys: per token = groups along head_dim (the engine's); per channel = along tokens
        kq = _fake(key, bits, d, 3, method) if kind == "token" else _fake(key, bits, block, 2, method)
        vq = _fake(value, bits, d, 3, method)  # values per token in every variant
        pos = torch.arange(seq)
        if residual == "own":
            exact = pos[:, None] == pos[None, :]
        else:
            exact = (pos[:, None] // block) == (pos[None, :] // block)
        causal = pos[None, :] <= pos[:, None]
        k, kq, v, vq = (t.repeat_interleave(groups, dim=1) for t in (key, kq, value, vq))
        scores = torch.where(exact, query @ k.transpose(2, 3), query @ kq.transpose(2, 3)) * scaling
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out = (probs * exact) @ v + (probs * ~exact) @ vq
        return out.transpose(1, 2).contiguous(), probs

    return attend


def key_channels(tokens: int, out: str) -> dict:
    """How uneven the keys' channels are (KIVI's observation): per layer and key-value head,
    the largest channel's mean |key| (after rotary) over the first `tokens` WikiText tokens,
    divided by the median channel's."""
    tf = import_transformers()
    ratios = []

    def probe(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        per_channel = key[0].abs().mean(1)  # (kv heads, head_dim)
        ratios.append(per_channel.max(1).values / per_channel.median(1).values)
        return tf.integrations.sdpa_attention.sdpa_attention_forward(module, query, key, value, attention_mask,
                                                                     scaling=scaling, dropout=dropout, **kwargs)

    tf.AttentionInterface.register("key_channels", probe)
    ids, source = wikitext_ids(smollm2_tokenizer(), tokens)
    with torch.no_grad():
        smollm2_model(attn_implementation="key_channels")(torch.tensor([ids]))
    r = torch.stack(ratios)
    rec = {"what": " ".join(key_channels.__doc__.split()), "tokens": len(ids), "data": source,
           "max_over_median_channel": {"median": r.median().item(), "min": r.min().item(), "max": r.max().item()},
           "command": "python -m flexgen_helm.tools.accuracy_sweep.kv_grouping " + " ".join(sys.argv[1:])}
    Path(out).write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexgen_helm.tools.accuracy_sweep.kv_grouping", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--block", type=int, default=64, help="KIVI's group of tokens per channel (and residual)")
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out", default=str(OUT / "json" / "kv_grouping.json"))
    p.add_argument("--key-channels", action="store_true",
                   help="instead: how uneven the keys' channels are (-> runs/accuracy/json/key_channels.json)")
    args = p.parse_args(argv)
    if args.key_channels:
        print(key_channels(args.tokens, str(OUT / "json" / "key_channels.json")))
        return 0
    tf = import_transformers()
    ids, source = wikitext_ids(smollm2_tokenizer(), args.tokens)
    results = []
    for name in args.variants:
        variant = VARIANTS[name]
        impl = "eager"
        if variant is not None:
            impl = "kv_sim_" + str(len(results))
            tf.AttentionInterface.register(impl, _attention(variant, args.bits, args.block))
        model = smollm2_model(attn_implementation=impl)
        results.append({"variant": name, "token_perplexity": token_perplexity(model, ids)})
        print(results[-1], flush=True)
        out = {"what": __doc__.split("\n\n")[0], "tokens": len(ids), "window": WINDOW, "bits": args.bits,
               "block": args.block, "data": source, "results": results,
               "command": "python -m flexgen_helm.tools.accuracy_sweep.kv_grouping " + " ".join(sys.argv[1:])}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")  # after each variant: nothing is lost
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
