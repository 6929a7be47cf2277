"""Issue 22 probe (session 19): where SmolLM2-135M's 4-bit LAMBADA loss comes from, and whether
AWQ-style activation-aware scaling (Lin et al., 2023) and a per-group clipping search close it.
Outside the engine: transformers on the GGUF (tools/accuracy_sweep/hf_reference.py) with
weights replaced by their quantize -> dequantize values, 4-bit, groups of 64 along the input
dim (the engine's default). The calibration text is the engine's own (16 x 128 tokens sampled
from the model: executor/calibration_text.py). An experiment, not a tool.

    python runs/accuracy/awq_probe/probe.py pipeline SCALE BODY HEAD [--lambada N] [--part P]
        SCALE: none | awq | awq-not-qkv | rotate    BODY, HEAD: fp | rtn | gptq | clip
        BODY may also be a list of QUANTIZER:PART steps, e.g. gptq:query-key,rtn:value-output,rtn:mlp
        P: all (default) | attention | mlp | query-key | value-output: the blocks' projections BODY quantizes
        scores the first N LAMBADA passages (500: the quick slice; 5153: all) and the first
        8,192 WikiText tokens; appends a record to json/pipelines.jsonl
    python runs/accuracy/awq_probe/probe.py head-states fp|embedding-rtn
        the final hidden states at every LAMBADA target position (all 5,153 passages), the
        body unquantized (and the input embedding by RTN, untied from the head): only the
        head changes below, so its variants score in seconds
    python runs/accuracy/awq_probe/probe.py head-variants fp|embedding-rtn
        the head alone quantized each way; appends to json/head_only.jsonl
    python runs/accuracy/awq_probe/probe.py rotation-check
        the figures behind README section 4; appends to json/rotation_check.jsonl
    python runs/accuracy/awq_probe/probe.py head-bias
        RTN's and GPTQ's head with and without bias correction (after head-states fp)
    python runs/accuracy/awq_probe/probe.py kl-tune rtn|gptq STEPS LR [--lambada N] [--text sampled|repeat]
        that grid on every projection and the head, then each group's scale and minimum tuned
        by Adam on KL(unquantized || quantized) over self-sampled text, codes fixed;
        appends to json/kl_tune.jsonl (README section 6)
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository, when run as a script

import scipy.linalg  # noqa: E402
import torch  # noqa: E402
from torch.nn.utils import parametrize  # noqa: E402

from flexgen_helm.compression import gptq  # noqa: E402
from flexgen_helm.compression.quantize import QuantizedTensor, codes_of, dequantize, quantize  # noqa: E402
from flexgen_helm.data.sources import read_lambada, read_wikitext  # noqa: E402
from flexgen_helm.evaluation.lambada import prepare  # noqa: E402
from flexgen_helm.evaluation.wikitext import tokenize  # noqa: E402
from flexgen_helm.policy.policy import Compression  # noqa: E402
from flexgen_helm.tools.accuracy_sweep.hf_reference import (  # noqa: E402
    smollm2_model,
    smollm2_tokenizer,
    token_perplexity,
)

GROUP = 64
RTN = Compression(4, GROUP, 1)
GPTQ = Compression(4, GROUP, 1, method="gptq")
ALPHAS = [i / 20 for i in range(21)]  # AWQ's scale exponents searched
SHRINKS = [1 - 0.025 * i for i in range(21)]  # clipping: a group's range shrunk about its centre, 1.0 .. 0.5
CLIP_TOKENS = 512  # calibration tokens the clipping search weighs a group's output error on
WIKITEXT_TOKENS = 8192
SCRATCH = Path("/tmp/awq_probe")

torch.set_grad_enabled(False)
if os.environ.get("PROBE_THREADS"):  # two probes side by side, one core each
    torch.set_num_threads(int(os.environ["PROBE_THREADS"]))


# ---- data and scoring -------------------------------------------------------------------

def lambada_items(n: int):
    texts, _ = read_lambada()
    return prepare(smollm2_tokenizer(), texts[:n])[0]


def wikitext_ids() -> list[int]:
    lines, _ = read_wikitext()
    return tokenize(smollm2_tokenizer(), lines, WIKITEXT_TOKENS)[0]


def padded(items, idx) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and attention mask of the passages idx."""
    length = max(len(items[i].full) for i in idx)
    ids = torch.zeros(len(idx), length, dtype=torch.long)
    mask = torch.zeros(len(idx), length, dtype=torch.long)
    for r, i in enumerate(idx):
        ids[r, :len(items[i].full)] = torch.tensor(items[i].full)
        mask[r, :len(items[i].full)] = 1
    return ids, mask


def target_rows(items, batch: int = 32):
    """(passage, its rows of a batch's output at the target-predicting positions) in length order."""
    order = sorted(range(len(items)), key=lambda i: len(items[i].full))
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        yield idx, padded(items, idx)


def lambada_scores(model, items) -> tuple[float, float]:
    """Accuracy (every target token the argmax) and last-word perplexity, as the engine's eval counts them."""
    correct, nll = 0, 0.0
    for idx, (ids, mask) in target_rows(items):
        logprobs = torch.log_softmax(model(ids, attention_mask=mask).logits.float(), -1)
        for r, i in enumerate(idx):
            k, target = len(items[i].context), items[i].target
            rows = logprobs[r, k - 1:k - 1 + len(target)]
            correct += rows.argmax(-1).tolist() == target
            nll -= rows.gather(-1, torch.tensor(target)[:, None]).sum().item()
    return correct / len(items), math.exp(nll / len(items))


# ---- quantizers (dequantized: the values the kernels would compute with) -----------------

def rtn(w: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(w, RTN, 1), torch.float32)


def gptq_grid(w: torch.Tensor, x: torch.Tensor) -> QuantizedTensor:
    blocks = gptq.column_blocks(w.shape[1], GROUP, 1)
    return gptq.gptq_quantize(w.float(), gptq.input_factors(x, blocks), blocks, GPTQ, 1, torch.float32)


def gptq_fit(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return dequantize(gptq_grid(w, x), torch.float32)


def on_grid(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int = 15) -> torch.Tensor:
    step = ((hi - lo) / levels).clamp(min=1e-12)
    return ((w - lo) / step).round().clamp(0, levels) * step + lo


def clip_fit(w: torch.Tensor, x: torch.Tensor, tokens: int = CLIP_TOKENS) -> torch.Tensor:
    """Per (row, group), the range shrink (SHRINKS) with the least error in that group's share
    of the output on `tokens` evenly spaced calibration inputs."""
    out_dim, in_dim = w.shape
    x = x.reshape(-1, in_dim)
    x = x[torch.linspace(0, x.shape[0] - 1, min(tokens, x.shape[0])).long()].float()
    wg = w.float().view(out_dim, -1, GROUP)
    xg = x.t().reshape(-1, GROUP, x.shape[0])
    lo0, hi0 = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    mid = (lo0 + hi0) / 2
    best_err = torch.full(wg.shape[:2], float("inf"))
    best = torch.empty_like(wg)
    for r in SHRINKS:
        qw = on_grid(wg, mid + (lo0 - mid) * r, mid + (hi0 - mid) * r)
        err = torch.einsum("ogk,gkt->ogt", qw - wg, xg).pow(2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better[..., None], qw, best)
    return best.view(out_dim, in_dim)


def fitted(how: str, w: torch.Tensor, x: torch.Tensor, clip_tokens: int = CLIP_TOKENS) -> torch.Tensor:
    if how == "clip":
        return clip_fit(w, x, clip_tokens)
    return dequantize(grid_fit(how, w, x), torch.float32)


def grid_fit(how: str, w: torch.Tensor, x: torch.Tensor) -> QuantizedTensor:
    """The codes, scales and minimums of RTN or GPTQ (clip keeps no grid of its own)."""
    if how == "rtn":
        return quantize(w, RTN, 1)
    if how == "gptq":
        return gptq_grid(w, x)
    raise SystemExit(f"unknown quantizer {how!r}: rtn, gptq or clip")


# ---- the model, layer by layer ---------------------------------------------------------

def embedded(model, ids: torch.Tensor):
    """The first block's inputs and the rotary (cos, sin) of the calibration ids."""
    h = model.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    return h, model.model.rotary_emb(h, positions)


def run_block(layer, h, rotary):
    out = layer(h, position_embeddings=rotary, attention_mask=None)  # no mask: causal
    return out[0] if isinstance(out, tuple) else out


def inputs_of(modules: dict, run) -> dict[str, torch.Tensor]:
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, k=k: seen.__setitem__(k, inp[0]))
             for k, m in modules.items()]
    run()
    for hook in hooks:
        hook.remove()
    return seen


def normalized(stat: torch.Tensor, alpha: float) -> torch.Tensor:
    s = stat.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def best_scale(stat, linears, run, expand=lambda s: s) -> torch.Tensor:
    """AWQ's search: s = stat^alpha on the input columns of `linears`, the alpha whose
    quantized output (run()) is closest to the unquantized one."""
    originals = [lin.weight.data.clone() for lin in linears]
    reference = run()
    best = (float("inf"), None)
    for alpha in ALPHAS:
        s = normalized(stat, alpha)
        for lin, w in zip(linears, originals):
            lin.weight.data = rtn(w * expand(s)) / expand(s)
        loss = (run() - reference).pow(2).mean().item()
        best = min(best, (loss, s), key=lambda b: b[0])
    for lin, w in zip(linears, originals):
        lin.weight.data = w
    return best[1]


def channel_mean(x: torch.Tensor) -> torch.Tensor:
    return x.abs().reshape(-1, x.shape[-1]).mean(0)


def awq_block(layer, x, rotary, qkv: bool = True):
    """Scale a block's four input groups (AWQ), each folded into what produces its input:
    the norms for q/k/v and gate/up, v for o (a kv channel's scale repeats over the query
    heads that share it), up for down. Returns the block's (unchanged) output.
    qkv=False leaves the q/k/v group unscaled."""
    attn, mlp = layer.self_attn, layer.mlp
    xn = layer.input_layernorm(x)
    if qkv:
        s = best_scale(channel_mean(xn), [attn.q_proj, attn.k_proj, attn.v_proj],
                       lambda: attn(xn, position_embeddings=rotary, attention_mask=None)[0])
        layer.input_layernorm.weight.data /= s
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            lin.weight.data *= s
    xn = layer.input_layernorm(x)
    ox = inputs_of({"o": attn.o_proj}, lambda: attn(xn, position_embeddings=rotary, attention_mask=None))["o"]
    hd, groups = attn.head_dim, attn.num_key_value_groups
    kv_heads = attn.k_proj.out_features // hd
    stat = ox.abs().reshape(-1, kv_heads, groups, hd).mean((0, 2)).reshape(-1)

    def per_query_head(s):
        return s.view(kv_heads, 1, hd).expand(kv_heads, groups, hd).reshape(-1)
    s = best_scale(stat, [attn.o_proj], lambda: attn.o_proj(ox), per_query_head)
    attn.v_proj.weight.data /= s[:, None]
    attn.o_proj.weight.data *= per_query_head(s)
    h = x + attn(xn, position_embeddings=rotary, attention_mask=None)[0]
    hn = layer.post_attention_layernorm(h)
    s = best_scale(channel_mean(hn), [mlp.gate_proj, mlp.up_proj], lambda: mlp(hn))
    layer.post_attention_layernorm.weight.data /= s
    for lin in (mlp.gate_proj, mlp.up_proj):
        lin.weight.data *= s
    hn = layer.post_attention_layernorm(h)
    dx = mlp.act_fn(mlp.gate_proj(hn)) * mlp.up_proj(hn)
    s = best_scale(channel_mean(dx), [mlp.down_proj], lambda: mlp.down_proj(dx))
    mlp.up_proj.weight.data /= s[:, None]
    mlp.down_proj.weight.data *= s
    return h + mlp(layer.post_attention_layernorm(h))


def awq_scale(model, ids, qkv: bool = True):
    h, rotary = embedded(model, ids)
    for layer in model.model.layers:
        h = awq_block(layer, h, rotary, qkv)


def orthogonal(n: int, seed: int) -> torch.Tensor:
    """A random n x n orthogonal matrix (QR of a seeded Gaussian, signs fixed)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def rotate(model):
    """Rotate the residual stream by a random orthogonal Q (QuaRot / SpinQuant, weights only):
    the norms' weights fold into the linears they feed (the head unties from the lookup), the
    linears reading the stream become W Q, those writing it Q^T W, the embedding E Q. Each
    value head rotates by a Hadamard matrix too (v's rows H^T W, o's head columns W H).
    Exact before quantization: RMSNorm with unit weight commutes with an orthogonal Q."""
    m = model.model
    q = orthogonal(m.embed_tokens.weight.shape[1], seed=0)
    head = m.embed_tokens.weight.detach().clone() * m.norm.weight.detach()
    model.lm_head.weight = torch.nn.Parameter(head @ q)
    m.norm.weight.data.fill_(1.0)
    m.embed_tokens.weight = torch.nn.Parameter(m.embed_tokens.weight.detach() @ q)
    for layer in m.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for norm, readers in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                              (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
            for lin in readers:
                lin.weight.data = (lin.weight.data * norm.weight.data) @ q
            norm.weight.data.fill_(1.0)
        for lin in (attn.o_proj, mlp.down_proj):
            lin.weight.data = q.t() @ lin.weight.data
        hd = attn.head_dim
        h = torch.tensor(scipy.linalg.hadamard(hd), dtype=torch.float32) / math.sqrt(hd)
        v = attn.v_proj.weight.data
        attn.v_proj.weight.data = torch.einsum("ji,hjc->hic", h, v.view(-1, hd, v.shape[1])).reshape(v.shape)
        o = attn.o_proj.weight.data
        attn.o_proj.weight.data = (o.view(o.shape[0], -1, hd) @ h).reshape(o.shape)


STEPS = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
PARTS = {"all": STEPS, "attention": STEPS[:2], "mlp": STEPS[2:], "query-key": [("q_proj", "k_proj")],
         "value-output": [("v_proj",), ("o_proj",)]}


def quantize_body(model, ids, how: str, part: str = "all", grids: dict | None = None):
    """Every block's projections (of `part`), in order, each fitted to the inputs the blocks
    quantized before it give it (true sequential); each one's grid kept in `grids` if given."""
    h, rotary = embedded(model, ids)
    for layer in model.model.layers:
        linears = {n: m for n, m in layer.named_modules() if n.split(".")[-1] in sum(STEPS, ())}
        by_name = {n.split(".")[-1]: m for n, m in linears.items()}
        for step in PARTS[part]:
            seen = inputs_of({n: by_name[n] for n in step}, functools.partial(run_block, layer, h, rotary))
            for n in step:
                if grids is None:
                    by_name[n].weight.data = fitted(how, by_name[n].weight.data, seen[n])
                else:
                    grids[by_name[n]] = grid_fit(how, by_name[n].weight.data, seen[n])
                    by_name[n].weight.data = dequantize(grids[by_name[n]], torch.float32)
        h = run_block(layer, h, rotary)


def quantize_head(model, ids, how: str, grids: dict | None = None):
    """The tied embedding / head, against the last hidden states of the model as it is now
    (untied by `rotate`: then the lookup takes RTN); its grid kept in `grids` if given."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    last = model.model(ids).last_hidden_state
    untied = head is not emb
    if grids is None:
        head.data = fitted(how, head.data, last, clip_tokens=last.shape[0] * last.shape[1])
    else:
        grids[model.lm_head] = grid_fit(how, head.data, last)
        head.data = dequantize(grids[model.lm_head], torch.float32)
    if untied:
        emb.data = rtn(emb.data)


SCALES = ("none", "awq", "awq-not-qkv", "rotate")
QUANTIZERS = ("rtn", "gptq", "clip")


def body_plan(body: str, part: str) -> list[tuple[str, str]]:
    """(quantizer, part) steps: BODY with --part, or a list 'gptq:query-key,rtn:value-output,...';
    every name checked here, before any work."""
    plan = [tuple(item.split(":", 1)) for item in body.split(",")] if ":" in body else \
        [] if body == "fp" else [(body, part)]
    for step in plan:
        if len(step) != 2 or step[0] not in QUANTIZERS or step[1] not in PARTS:
            raise SystemExit(f"bad body step {':'.join(step)!r}: QUANTIZER:PART with QUANTIZER one of "
                             f"{', '.join(QUANTIZERS)} and PART one of {', '.join(PARTS)}")
    return plan


def calibration_ids() -> torch.Tensor:
    """The engine's calibration text for SmolLM2-135M (sampled once, then cached)."""
    cached = SCRATCH / "calibration.pt"
    if cached.exists():
        return torch.load(cached, weights_only=True)
    import tempfile

    from flexgen_helm.engine import weight_calibration
    from flexgen_helm.weights.registry import resolve
    calibration = weight_calibration(resolve("smollm2-135m"), GPTQ, Path(tempfile.mkdtemp()), False)
    ids = torch.tensor(calibration.sample(calibration.text))
    SCRATCH.mkdir(exist_ok=True)
    torch.save(ids, cached)
    return ids


# ---- commands ---------------------------------------------------------------------------

def pipeline(scale: str, body: str, head: str, passages: int, part: str) -> dict:
    plan = body_plan(body, part)
    if scale not in SCALES:
        raise SystemExit(f"unknown scale {scale!r}: one of {', '.join(SCALES)}")
    if head not in ("fp", *QUANTIZERS):
        raise SystemExit(f"unknown head quantizer {head!r}: fp or one of {', '.join(QUANTIZERS)}")
    model, ids = smollm2_model(), calibration_ids()
    t0 = time.perf_counter()
    if scale in ("awq", "awq-not-qkv"):
        awq_scale(model, ids, qkv=scale == "awq")
    elif scale == "rotate":
        rotate(model)
    for how, how_part in plan:
        quantize_body(model, ids, how, how_part)
    if head != "fp":
        quantize_head(model, ids, head)
    fit_s = time.perf_counter() - t0
    accuracy, last_word = lambada_scores(model, lambada_items(passages))
    return {"scale": scale, "body": body, "body_part": part if ":" not in body else None, "head": head,
            "fit_s": round(fit_s, 1), "lambada_passages": passages,
            "lambada_accuracy": accuracy, "last_word_perplexity": last_word,
            "wikitext_tokens": WIKITEXT_TOKENS, "wikitext_perplexity": token_perplexity(model, wikitext_ids())}


def rotation_check() -> dict:
    """README section 4's figures: the rotation's exactness, RTN's relative weight error before
    and after it (layer 5), and the residual stream's largest channels with their norm weights."""
    model, ids = smollm2_model(), calibration_ids()[:2]
    hidden = model(ids, output_hidden_states=True).hidden_states
    channels = {}
    for index in (3, 10, 20):
        x, g = hidden[index], model.model.layers[index].input_layernorm.weight
        top = x.abs().mean((0, 1)).topk(3).indices
        channels[index] = {"channels": top.tolist(), "norm_weights": g[top].tolist(),
                           "median_norm_weight": g.abs().median().item(),
                           "energy_share": (x[..., top].pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()}

    def errors():
        layer = model.model.layers[5]
        weights = {"q": layer.self_attn.q_proj, "k": layer.self_attn.k_proj, "v": layer.self_attn.v_proj,
                   "up": layer.mlp.up_proj}
        return {n: ((rtn(m.weight.data) - m.weight.data).norm() / m.weight.data.norm()).item()
                for n, m in weights.items()}
    q_blocks = model.model.layers[5].self_attn.q_proj.weight.data.view(-1, 32)  # the source's Q4_1 blocks
    distinct = sum(len(torch.unique(block)) for block in q_blocks) / q_blocks.shape[0]
    before, reference = errors(), model(ids[:, :64]).logits
    rotate(model)
    return {"max_logit_change": (model(ids[:, :64]).logits - reference).abs().max().item(),
            "largest_logit": reference.abs().max().item(),
            "rtn_relative_error_layer5": {"before": before, "after": errors()},
            "layer5_q_distinct_values_per_32_block": distinct,
            "calibration_tokens": list(ids.shape), "residual_channels_by_layer": channels}


def head_states(mode: str) -> None:
    model = smollm2_model()
    if mode == "embedding-rtn":  # untie: the lookup takes RTN codes, the head stays exact
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
        model.model.embed_tokens.weight.data = rtn(model.model.embed_tokens.weight.data)
    items = lambada_items(5153)
    states, targets, owner = [], [], []
    for idx, (ids, mask) in target_rows(items):
        last = model.model(ids, attention_mask=mask).last_hidden_state
        for r, i in enumerate(idx):
            k, target = len(items[i].context), items[i].target
            states.append(last[r, k - 1:k - 1 + len(target)].clone())
            targets += target
            owner += [i] * len(target)
    SCRATCH.mkdir(exist_ok=True)
    torch.save({"states": torch.cat(states), "targets": torch.tensor(targets), "owner": torch.tensor(owner),
                "passages": len(items)}, SCRATCH / f"head_states_{mode}.pt")


def head_scores(saved: dict, head: torch.Tensor) -> tuple[float, float]:
    logprobs = torch.log_softmax(saved["states"] @ head.t(), -1)
    wrong = logprobs.argmax(-1) != saved["targets"]
    nll = -logprobs.gather(-1, saved["targets"][:, None])[:, 0].double()
    missed = torch.zeros(saved["passages"], dtype=torch.bool)
    missed[saved["owner"][wrong]] = True
    per_passage = torch.zeros(saved["passages"], dtype=torch.float64).index_add_(0, saved["owner"], nll)
    return 1 - missed.float().mean().item(), math.exp(per_passage.mean().item())


def head_inputs(mode: str):
    """The saved LAMBADA states (head-states MODE), the tied tensor, and the calibration's last states."""
    saved = torch.load(SCRATCH / f"head_states_{mode}.pt", weights_only=True)
    model, ids = smollm2_model(), calibration_ids()
    return saved, model.model.embed_tokens.weight.detach().clone(), model.model(ids).last_hidden_state


def head_variants(mode: str) -> list[dict]:
    saved, emb, last = head_inputs(mode)
    heads = {"fp": emb, "rtn": rtn(emb), "gptq": gptq_fit(emb, last),
             "clip": clip_fit(emb, last, last.shape[0] * last.shape[1]),
             "hqq": dequantize(quantize(emb, Compression(4, GROUP, 1, method="hqq"), 1), torch.float32)}
    rows = []
    for name, head in heads.items():
        accuracy, last_word = head_scores(saved, head)
        rows.append({"body": mode, "head": name, "lambada_passages": saved["passages"],
                     "lambada_accuracy": accuracy, "last_word_perplexity": last_word})
    return rows


def bias_corrected(w: torch.Tensor, wq: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """wq with each row's group minimums shifted (least-norm) so the row's error is zero on
    the mean input mu: bias correction inside the same codes."""
    shift = (wq - w) @ mu
    group_sums = mu.view(-1, GROUP).sum(-1)
    delta = -shift[:, None] * group_sums[None] / group_sums.pow(2).sum()
    return wq + delta.repeat_interleave(GROUP, 1)


def head_bias() -> list[dict]:
    """RTN's and GPTQ's head, each with and without bias correction, against the mean of the
    calibration's last states and (an oracle) of LAMBADA's target states."""
    saved, emb, last = head_inputs("fp")
    heads = {"rtn": rtn(emb), "gptq": gptq_fit(emb, last)}
    means = {"calibration": last.reshape(-1, emb.shape[1]).mean(0), "lambada-oracle": saved["states"].mean(0)}
    rows = []
    for mean_of, mu in means.items():
        for name, head in heads.items():
            for corrected in (False, True):
                accuracy, last_word = head_scores(saved, bias_corrected(emb, head, mu) if corrected else head)
                rows.append({"body": "fp", "head": name, "bias_corrected_on": mean_of if corrected else None,
                             "lambada_passages": saved["passages"], "lambada_accuracy": accuracy,
                             "last_word_perplexity": last_word})
    return rows


# ---- end-to-end tuning of the grids' scales and minimums (data-free, KL to the model) ----

class TunedGrid(torch.nn.Module):
    """A weight as code * scale + minimum per group, the codes fixed (so the packed format is
    kept) and each group's scale and minimum trainable, relative to their fitted values:
    scale0 * exp(gain), min0 + scale0 * shift."""

    def __init__(self, q: QuantizedTensor):
        super().__init__()
        self.shape = q.shape
        self.register_buffer("codes", codes_of(q).float().view(q.shape[0], -1, GROUP))
        self.register_buffer("scale0", q.scale.float()[..., None])
        self.register_buffer("min0", q.min.float()[..., None])
        self.gain = torch.nn.Parameter(torch.zeros_like(self.scale0))
        self.shift = torch.nn.Parameter(torch.zeros_like(self.scale0))

    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        scale = self.scale0 * self.gain.exp()
        return (self.codes * scale + self.min0 + self.scale0 * self.shift).view(self.shape)


def self_samples(model, start: int, sequences: int, length: int, seed: int) -> torch.Tensor:
    """`sequences` texts of `length` tokens sampled from the model itself at temperature 1
    from its start token (the calibration text's recipe, another seed)."""
    torch.manual_seed(seed)
    prompt = torch.full((sequences, 1), start)
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                          top_k=0, top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1)


def teacher_logprobs(model, texts: torch.Tensor, batch: int) -> torch.Tensor:
    return torch.cat([torch.log_softmax(model(texts[i:i + batch]).logits, -1).bfloat16()
                      for i in range(0, len(texts), batch)])


def token_kl(teacher: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) at each position, from the two log-probabilities."""
    return (teacher.exp() * (teacher - logp)).sum(-1)


def kl_and_agreement(model, texts, teacher, batch: int) -> tuple[float, float]:
    """Mean KL(teacher || model) per token and the share of tokens whose argmax agrees."""
    kl, agree = 0.0, 0.0
    for i in range(0, len(texts), batch):
        logp = torch.log_softmax(model(texts[i:i + batch]).logits, -1)
        t = teacher[i:i + batch].float()
        kl += token_kl(t, logp).sum().item()
        agree += (t.argmax(-1) == logp.argmax(-1)).sum().item()
    tokens = texts.shape[0] * texts.shape[1]
    return kl / tokens, agree / tokens


def repeated(texts: torch.Tensor) -> torch.Tensor:
    """Every other sequence's second half replaced by its first half: text whose continuation
    is in its context, as a LAMBADA target word is, made from the samples alone."""
    out, half = texts.clone(), texts.shape[1] // 2
    out[1::2, half:2 * half] = texts[1::2, :half]
    return out


TEXTS = {"sampled": lambda t: t, "repeat": repeated}


def kl_tune(body: str, steps: int, lr: float, passages: int, text: str = "sampled", sequences: int = 128,
            length: int = 128, batch: int = 8) -> dict:
    """BODY's (rtn or gptq) grids on every projection and the tied head, then their scales and
    minimums tuned by Adam on KL(unquantized || quantized) over self-sampled text (TEXT:
    sampled as is, or repeat: half of it made to repeat itself)."""
    if body not in ("rtn", "gptq"):
        raise SystemExit(f"kl-tune tunes the grids of rtn or gptq, not {body!r}")
    if text not in TEXTS:
        raise SystemExit(f"unknown text {text!r}: one of {', '.join(TEXTS)}")
    model, ids = smollm2_model(), calibration_ids()
    t0 = time.perf_counter()
    start = int(ids[0, 0])
    texts = TEXTS[text](self_samples(model, start, sequences, length, seed=1))
    held_out = TEXTS[text](self_samples(model, start, 16, length, seed=2))
    teacher, teacher_held = teacher_logprobs(model, texts, batch), teacher_logprobs(model, held_out, batch)
    sample_s = time.perf_counter() - t0
    grids = {}
    quantize_body(model, ids, body, "all", grids)
    quantize_head(model, ids, body, grids)
    fit_s = time.perf_counter() - t0 - sample_s
    before = kl_and_agreement(model, held_out, teacher_held, batch)
    for p in model.parameters():
        p.requires_grad_(False)
    tuned = {module: TunedGrid(q) for module, q in grids.items()}
    params = [p for t in tuned.values() for p in t.parameters()]
    tuned[model.model.embed_tokens] = tuned[model.lm_head]  # the tied lookup reads the head's grid
    for module, grid in tuned.items():
        parametrize.register_parametrization(module, "weight", grid, unsafe=True)
    opt = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    order = torch.Generator().manual_seed(3)
    losses = []
    t1 = time.perf_counter()
    with torch.enable_grad():
        for step in range(steps):
            pick = torch.randperm(len(texts), generator=order)[:batch]
            logp = torch.log_softmax(model(texts[pick]).logits, -1)
            t = teacher[pick].float()
            loss = token_kl(t, logp).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
            if step % 10 == 0 or step == steps - 1:
                print(f"step {step} kl {loss.item():.4f} ({time.perf_counter() - t1:.0f} s)", flush=True)
    tune_s = time.perf_counter() - t1
    for module in tuned:
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    after = kl_and_agreement(model, held_out, teacher_held, batch)
    accuracy, last_word = lambada_scores(model, lambada_items(passages))
    return {"body": body, "head": body, "tuning": "kl-scales-mins", "text": text, "steps": steps, "lr": lr,
            "train_texts": [sequences, length], "batch": batch, "sample_s": round(sample_s, 1),
            "fit_s": round(fit_s, 1), "tune_s": round(tune_s, 1),
            "first_losses": losses[:5], "last_losses": losses[-5:],
            "held_out_kl": {"before": before[0], "after": after[0]},
            "held_out_top1_agreement": {"before": before[1], "after": after[1]},
            "lambada_passages": passages, "lambada_accuracy": accuracy, "last_word_perplexity": last_word,
            "wikitext_tokens": WIKITEXT_TOKENS, "wikitext_perplexity": token_perplexity(model, wikitext_ids())}


def append(name: str, rows: list[dict], command: str) -> None:
    with open(HERE / "json" / name, "a") as f:
        for row in rows:
            print(row, flush=True)
            f.write(json.dumps({**row, "command": command}) + "\n")


def main(argv: list[str]) -> None:
    command = "python runs/accuracy/awq_probe/probe.py " + " ".join(argv)
    (HERE / "json").mkdir(exist_ok=True)
    if argv[0] == "pipeline":
        passages = int(argv[argv.index("--lambada") + 1]) if "--lambada" in argv else 500
        part = argv[argv.index("--part") + 1] if "--part" in argv else "all"
        append("pipelines.jsonl", [pipeline(*argv[1:4], passages, part)], command)
    elif argv[0] == "head-states":
        head_states(argv[1])
    elif argv[0] == "head-variants":
        append("head_only.jsonl", head_variants(argv[1]), command)
    elif argv[0] == "rotation-check":
        append("rotation_check.jsonl", [rotation_check()], command)
    elif argv[0] == "kl-tune":
        passages = int(argv[argv.index("--lambada") + 1]) if "--lambada" in argv else 500
        text = argv[argv.index("--text") + 1] if "--text" in argv else "sampled"
        append("kl_tune.jsonl", [kl_tune(argv[1], int(argv[2]), float(argv[3]), passages, text)], command)
    elif argv[0] == "head-bias":
        append("head_only.jsonl", head_bias(), command)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
