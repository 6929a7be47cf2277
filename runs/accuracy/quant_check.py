"""Outside-the-engine check of weight quantization on SmolLM2-135M: transformers (which
dequantizes the GGUF itself) with weights replaced by quantize -> dequantize, WikiText
perplexity on the first 2048 tokens (2 windows of 1024). Answers two questions the table
raises: how much of the 4-bit loss comes from quantizing the token embedding (tied to the
output head), and whether groups of 32 along the input dim are lossless for the Q4_1
projections. Writes json/quant_check.json (read by the report).

    python runs/accuracy/quant_check.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository, when run as a script

from flexgen_helm.compression.quantize import dequantize, quantize  # noqa: E402
from flexgen_helm.policy.policy import Compression  # noqa: E402
from flexgen_helm.tools.accuracy_sweep.hf_reference import (  # noqa: E402
    WINDOW,
    smollm2_model,
    smollm2_tokenizer,
    token_perplexity,
    wikitext_ids,
)

TOKENS = 2048
VARIANTS = [(None, None, None)] + [(g, dim, embed) for g, dim in ((64, 0), (64, 1), (32, 1)) for embed in (True, False)]


def main() -> None:
    model = smollm2_model()
    ids, source = wikitext_ids(smollm2_tokenizer(), TOKENS)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}

    results = []
    for group, dim, embed in VARIANTS:
        for name, p in model.named_parameters():
            x = original[name]
            # every >= 2-D weight, as the engine does; embed=False leaves the (tied) embedding alone
            if group and x.dim() >= 2 and (embed or "embed_tokens" not in name):
                x = dequantize(quantize(x, Compression(4, group, dim), dim))
            p.data.copy_(x)
        results.append({"bits": 4 if group else None, "group_size": group, "group_dim": dim,
                        "embedding_quantized": embed, "token_perplexity": token_perplexity(model, ids)})
        print(results[-1], flush=True)
    out = {"what": __doc__.split("\n\n")[0], "tokens": len(ids), "window": WINDOW, "data": source,
           "tied_embeddings": bool(model.config.tie_word_embeddings), "results": results,
           "command": "python runs/accuracy/quant_check.py"}
    (HERE / "json" / "quant_check.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
