"""torch.profiler's op table for one score batch of wikitext_engine.py's first 5 paragraphs, BF16 and
the 4-bit deployment, after two warm-up calls each: where the 4-bit batch's extra time goes.

    PYTHONPATH=<checkout> python profile_wikitext.py
"""

import torch
from wikitext_engine import DEPLOYMENTS, load_engines, paragraphs


def main() -> None:
    engines = load_engines(DEPLOYMENTS)
    prompts = paragraphs(engines["bf16"])[:5]
    for name, engine in engines.items():
        for _ in range(2):
            engine.score(prompts, top_logprobs=1)
        with torch.profiler.profile() as prof:
            engine.score(prompts, top_logprobs=1)
        print("=====", name)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
