"""Does GPTQ's fit carry over to text it did not see? For four of SmolLM2-135M's linear
layers, the relative output error sum((W - Q) H (W - Q)^T) / sum(W H W^T) of RTN and of GPTQ
at several dampings, with H the input Hessian of two texts: the calibration text GPTQ fits
(sampled from the model, as the engine samples it: executor/calibration_text.py) and 4,096
WikiText-2 test tokens from token 100,000 on (outside the quick slice; a measurement here,
never a calibration). Inputs are those of the unquantized model (transformers on the GGUF).
4-bit, groups of 64 along the input dim. Writes json/gptq_heldout.json.

    python runs/accuracy/gptq_heldout.py
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository, when run as a script

import torch  # noqa: E402

from flexgen_helm.compression import gptq  # noqa: E402
from flexgen_helm.compression.quantize import dequantize, quantize  # noqa: E402
from flexgen_helm.engine import weight_calibration  # noqa: E402
from flexgen_helm.policy.policy import Compression  # noqa: E402
from flexgen_helm.tools.accuracy_sweep.hf_reference import smollm2_model, smollm2_tokenizer, wikitext_ids  # noqa: E402
from flexgen_helm.weights.registry import resolve  # noqa: E402

LAYERS = ["model.layers.0.self_attn.q_proj", "model.layers.10.mlp.down_proj", "model.layers.20.self_attn.o_proj",
          "model.layers.29.mlp.up_proj"]
DAMPINGS = [0.01, 0.1, 0.3, 1.0]
HELD_OUT = (100_000, 16, 256)  # first token, sequences, tokens each
CFG = Compression(bits=4, group_size=64, group_dim=1, method="gptq")


def layer_inputs(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    modules, seen = dict(model.named_modules()), {}

    def keep(name):
        def hook(module, inputs, output):  # returns None: the output stays as it is
            seen[name] = inputs[0].reshape(-1, inputs[0].shape[-1])
        return hook
    hooks = [modules[n].register_forward_hook(keep(n)) for n in LAYERS]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def relative_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    d = w - q
    return float(((d @ h) * d).sum() / ((w @ h) * w).sum())


def main() -> None:
    model = smollm2_model()
    calibration = weight_calibration(resolve("smollm2-135m"), CFG, Path(tempfile.mkdtemp()), False)
    fit_ids = torch.tensor(calibration.sample(calibration.text))
    first, n, length = HELD_OUT
    ids, _ = wikitext_ids(smollm2_tokenizer(), first + n * length)
    held_ids = torch.tensor(ids[first:]).view(n, length)
    fit, held = layer_inputs(model, fit_ids), layer_inputs(model, held_ids)
    modules = dict(model.named_modules())
    rows = []
    for name in LAYERS:
        w = modules[name].weight.detach().float()
        h_fit, h_held = (x.t() @ x / x.shape[0] for x in (fit[name], held[name]))
        rtn = dequantize(quantize(w, dataclasses.replace(CFG, method="rtn"), 1), torch.float32)
        row = {"layer": name, "shape": list(w.shape), "rtn": [relative_error(w, rtn, h_fit),
                                                            relative_error(w, rtn, h_held)]}
        blocks = gptq.column_blocks(w.shape[1], CFG.group_size, 1)
        for damp in DAMPINGS:
            with mock.patch.object(gptq, "DAMP", damp):
                q = dequantize(gptq.gptq_quantize(w, gptq.input_factors(fit[name], blocks), blocks, CFG, 1,
                                                  torch.float32), torch.float32)
            row[f"gptq damp {damp:g}"] = [relative_error(w, q, h_fit), relative_error(w, q, h_held)]
        rows.append(row)
        print(name, {k: [round(x, 5) for x in v] for k, v in row.items() if isinstance(v, list) and k != "shape"},
              flush=True)
    out = {"calibration_tokens": list(fit_ids.shape), "held_out": {"first_token": first, "shape": [n, length]},
           "errors": "relative output error [on the calibration text, on the held-out WikiText]", "rows": rows}
    (HERE / "json" / "gptq_heldout.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
