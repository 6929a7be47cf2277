"""Can int8 x int8 (W8A8) linears be exact enough on the bundled SmolLM2-135M? (issue 48)

An accuracy experiment, not an engine path: every configuration runs `flexgen-helm eval` on
the BF16 deployment with the Llama family's linears replaced, inside this process, by a
simulation of the 8-bit path under test (the weights taken from the deployment's own bf16
tensors, so every configuration starts from the same weights):

- w8: weight-only 8-bit, one group per output channel, min/max (int8.py's PackedInt8 grid,
  computed as its dense path does: F.linear on the dequantized weight in bfloat16); it
  should reproduce the engine's `--compress-weight --compress-bits 8 --compress-group-size -1`.
- w8a8: the same weight codes times int8 activations, each token's row quantized
  symmetrically to -127..127 on its own max |x| (dynamic, per token); the product of the codes
  accumulated exactly by torch._int_mm (int32), then the epilogue in float32:
  acc * a * s + sum(x) * zero (the weight's per-row zero meets the sum of the row of x).
- sq<alpha>: SmoothQuant (Xiao et al., 2023): per input channel c of each linear,
  s_c = max|X_c|^alpha / max|W_c|^(1 - alpha), X_c from calibration activations (the text
  GPTQ calibrates on, executor/calibration_text.py: sampled from the model itself, so the
  evaluation sets stay unseen), the weight quantized as W diag(s) and x multiplied by 1/s
  before its quantization (the same product in exact arithmetic).
- keep=<roles>: those linears stay weight-only 8-bit (e.g. down, head).
- g<k>: activations quantized per token per group of k input channels (each group's products
  summed with its own scale: k / channels int8 matmuls per linear).

The embedding (tied to the head in SmolLM2) is looked up in the 8-bit codes in every
configuration but bf16, as the engine's 8-bit deployment does.

    PYTHONPATH=. python runs/compression_8bit/w8a8_accuracy.py --configs bf16 w8 w8a8 sq0.5 \\
        --lambada-limit 1000 --wikitext-limit 60000 --json runs/compression_8bit/w8a8_accuracy.json

Accuracy only (the machine may be shared); the JSON holds the command, the host
(memory.machine.machine_label), each configuration's metrics and its eval records.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flexgen_helm.models.llama as llama
from flexgen_helm.cli import main as cli_main
from flexgen_helm.compression.int8 import dequantize_int8, pack_int8
from flexgen_helm.compression.quantize import quantize
from flexgen_helm.engine import Engine
from flexgen_helm.executor.calibration_text import CalibrationText
from flexgen_helm.memory.machine import machine_label
from flexgen_helm.policy.policy import PER_CHANNEL, Compression, Policy

W8 = Compression(8, PER_CHANNEL)
ROLES = {"q_proj.weight": "q", "k_proj.weight": "k", "v_proj.weight": "v", "o_proj.weight": "o",
         "gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down", "lm_head.weight": "head"}
CONFIG = re.compile(r"^(bf16|w8|w8a8|sq(?P<alpha>[0-9.]+))(?:-g(?P<group>\d+))?(?:-keep=(?P<keep>[a-z,]+))?$")


class Setting:
    """One configuration (module doc), parsed from its name."""

    def __init__(self, name: str):
        m = CONFIG.match(name)
        if m is None:
            raise SystemExit(f"unknown configuration {name!r}: bf16, w8, w8a8 or sq<alpha>, then optional "
                             "-g<k> and -keep=<roles> (roles: " + ",".join(ROLES.values()) + ")")
        self.name = name
        self.kind = m.group(1) if m.group("alpha") is None else "sq"
        self.alpha = float(m.group("alpha")) if m.group("alpha") else None
        self.group = int(m.group("group")) if m.group("group") else None
        self.keep = set(m.group("keep").split(",")) if m.group("keep") else set()
        if self.keep - set(ROLES.values()):
            raise SystemExit(f"{name}: unknown roles {sorted(self.keep - set(ROLES.values()))}")


class State:
    setting: Setting | None = None  # None: plain bf16, recording activations when `record`
    record: dict | None = None  # (block, role) -> max |x| per input channel (float32)
    stats: dict = {}
    block = -1  # the block whose qkv ran last: finish_block's (schedule runs them in turn)
    weights: dict = {}  # (block, role, alpha) -> what the simulated linear computes with
    seen: dict = {}  # (block, role) -> data_ptr of the deployment's weight, to check the block tracking


def _quantized(w: torch.Tensor, s: torch.Tensor | None):
    """PackedInt8 of w (times s per input channel, in float32) and its dequantized bf16."""
    src = w.float() * s if s is not None else w
    p = pack_int8(quantize(src, W8, 1), torch.bfloat16)
    return p, dequantize_int8(p, torch.bfloat16)


def _act_int8(x: torch.Tensor, group: int | None):
    """Per-token (per group of `group` channels) symmetric int8 of float32 x: codes, scales."""
    rows, k = x.shape
    g = group or k
    xg = x.view(rows, k // g, g)
    a = xg.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return torch.round(xg / a).clamp_(-127, 127).to(torch.int8), a


class Sim:
    """The deployment's bf16 weight in a block's linear, computing as State.setting says."""

    def __init__(self, block: int, role: str, w: torch.Tensor):
        self.block, self.role, self.w = block, role, w
        ptr = State.seen.setdefault((block, role), w.data_ptr())
        if ptr != w.data_ptr():
            raise RuntimeError(f"block tracking lost: {(block, role)} came with another weight")

    def linear(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        st = State.setting
        if st is None:
            if State.record is not None:
                m = x.reshape(-1, x.shape[-1]).float().abs().amax(0)
                key = (self.block, self.role)
                State.record[key] = torch.maximum(State.record[key], m) if key in State.record else m
            return F.linear(x, self.w, bias)
        weight_only = st.kind == "w8" or self.role in st.keep
        alpha = None if weight_only or st.kind != "sq" else st.alpha
        key = (self.block, self.role, alpha)
        if key not in State.weights:
            s = None
            if alpha is not None:
                xmax = State.stats[(self.block, self.role)].clamp_min(1e-5)
                wmax = self.w.float().abs().amax(0).clamp_min(1e-5)
                s = (xmax.pow(alpha) / wmax.pow(1 - alpha)).clamp_min(1e-5)
            State.weights[key] = (*_quantized(self.w, s), s)
        p, dense, s = State.weights[key]
        if weight_only:
            return F.linear(x, dense, bias)
        shape = x.shape
        xf = x.reshape(-1, shape[-1]).float()
        xs = xf / s if s is not None else xf
        qx, a = _act_int8(xs, st.group)
        rows, k = xf.shape
        g = st.group or k
        # torch._int_mm: int8 x int8 -> int32, exact; one product per group of input channels
        y = None
        for j in range(k // g):
            part = torch._int_mm(qx[:, j], p.packed[:, j * g:(j + 1) * g].t()).float().mul_(a[:, j])
            y = part if y is None else y.add_(part)
        y.mul_(p.scales.float()).addcmul_(xs.sum(-1, keepdim=True), p.zeros.float()[None])  # in place: rows x out
        y = y.to(x.dtype).view(*shape[:-1], -1)
        return y + bias if bias is not None else y


def _wrap(w: dict, block: int) -> dict:
    return {k: Sim(block, ROLES[k], v) if k in ROLES and isinstance(v, torch.Tensor) else v for k, v in w.items()}


_qkv, _finish, _head, _embed = llama.qkv, llama.finish_block, llama.head, llama.embed
_embed_q: dict = {}


def qkv(cfg, w, h, at, block):
    State.block = block
    return _qkv(cfg, _wrap(w, block), h, at, block)


def finish_block(cfg, w, h, attn):
    return _finish(cfg, _wrap(w, State.block), h, attn)


def head(cfg, w, h):
    return _head(cfg, _wrap(w, -1), h)


def embed(cfg, w, ids, positions):
    if State.setting is None:
        return _embed(cfg, w, ids, positions)
    t = w["tokens.weight"]
    if t.data_ptr() not in _embed_q:
        _embed_q[t.data_ptr()] = _quantized(t, None)[1]
    return _embed(cfg, {**w, "tokens.weight": _embed_q[t.data_ptr()]}, ids, positions)


llama.qkv, llama.finish_block, llama.head, llama.embed = qkv, finish_block, head, embed


def calibrate(model: str) -> dict:
    """max |x| per input channel of every linear, over the calibration text sampled by the
    bf16 model (CalibrationText's defaults: 16 sequences of 128 tokens)."""
    text = CalibrationText()
    engine = Engine.load(model, Policy(gpu_batch_size=text.sequences), progress=False)
    State.setting, State.record = None, {}
    try:
        run = engine.generate(*text.requests(engine.config))
    finally:
        engine.close()
    stats, State.record = State.record, None
    print(f"calibration: {sum(len(r.completions[0].token_ids) + 1 for r in run.results)} tokens, "
          f"{len(stats)} linears", flush=True)
    return stats


def evaluate(setting: Setting, task: str, limit: int, model: str, tmp: Path) -> dict:
    State.setting = None if setting.kind == "bf16" else setting
    State.seen.clear()
    out = tmp / f"{setting.name}-{task}.json"
    out.unlink(missing_ok=True)
    argv = ["eval", "--model", model, "--task", task, "--limit", str(limit), "--quiet", "--json", str(out)]
    t0 = time.perf_counter()
    if cli_main(argv) != 0:
        raise RuntimeError(f"{setting.name} {task} failed")
    record = json.loads(out.read_text())
    return {"metrics": record["metrics"], "counts": record["counts"], "wall_s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=["bf16", "w8", "w8a8", "sq0.5"])
    ap.add_argument("--tasks", nargs="+", default=["lambada", "wikitext"], choices=["lambada", "wikitext"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lambada-limit", type=int, default=1000)
    ap.add_argument("--wikitext-limit", type=int, default=60000)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    settings = [Setting(c) for c in args.configs]
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update(command="PYTHONPATH=. python " + " ".join(sys.argv), host=machine_label(),
                  calibration=CalibrationText().settings())
    results = result.setdefault("results", {})
    if any(s.kind == "sq" for s in settings):
        State.stats = calibrate(args.model)
    with tempfile.TemporaryDirectory(prefix="wt48-w8a8-") as tmp:
        for s in settings:
            for task in args.tasks:
                limit = args.lambada_limit if task == "lambada" else args.wikitext_limit
                r = evaluate(s, task, limit, args.model, Path(tmp))
                results.setdefault(s.name, {})[f"{task}-{limit}"] = r
                print(s.name, task, limit, json.dumps(r["metrics"]), f"{r['wall_s']:.0f} s", flush=True)
                path.write_text(json.dumps(result, indent=1) + "\n")
            State.weights.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
