"""The plan of the accuracy table in runs/accuracy/: its rows (one approximation each), the
scopes (the reference protocol's slice, the full sets) and the `flexgen-helm eval` command
that makes each record."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

OUT = Path("runs/accuracy")
MODEL = ["--model", "smollm2-135m", "--dtype", "float32", "--num-gpu-batches", "1"]
# windows of 1024 tokens are ~30x longer than LAMBADA passages: fewer per batch keeps the
# (batch x heads x 1024 x 1024) attention scores of the prefill small on a shared machine
BATCH = {"lambada": ["--gpu-batch-size", "32"], "wikitext": ["--gpu-batch-size", "8", "--window", "1024"]}
# "lim": the protocol of the reference numbers (first 400 passages, first 16 windows of 1024)
# "quick": the slice a new method is checked on before its full-set runs (issue 22)
SCOPES = {"full": {"lambada": [], "wikitext": []},
          "lim": {"lambada": ["--limit", "400"], "wikitext": ["--limit", "16384"]},
          "quick": {"lambada": ["--limit", "500"], "wikitext": ["--limit", "8192"]}}


def _compress(what: str, bits: int, group: int, dim: int | None = None, method: str = "rtn",
              cache: str = "per-token") -> list[str]:
    """cache: the cache's grouping, named (the rows measured before KIVI ran per-token)."""
    flags = {"w": ["--compress-weight"], "kv": ["--compress-cache"],
             "both": ["--compress-weight", "--compress-cache"]}[what]
    flags += ["--compress-bits", str(bits), "--compress-group-size", str(group)]
    flags += ["--quant-method", method] if method != "rtn" else []
    flags += ["--cache-grouping", cache] if what != "w" else []
    # one --compress-group-dim serves weights and cache alike: name it only for weights alone
    return flags + (["--compress-group-dim", str(dim)] if dim is not None else [])


@dataclass(frozen=True)
class Row:
    name: str
    label: str
    flags: list[str] = field(default_factory=list)
    # LAMBADA accuracy by greedy generation too (on "lim"): rows whose approximations act in
    # decode; elsewhere it equals the scoring accuracy (tests/test_evaluation.py)
    generate: bool = False
    scopes: tuple[str, ...] = ("lim", "full")

    @property
    def acts_in_decode(self) -> bool:
        """A compressed cache or sparse attention: scored as decode (--score-as-decode), since a
        plain score's prefill attends to fresh keys and values, where neither acts."""
        return "--compress-cache" in self.flags or "--attn-sparsity" in self.flags


SCOPES_ORDER = ("lim", "quick", "full")
ALL = SCOPES_ORDER
NEW = ("quick", "full")  # rows of issue 22 (RTN vs fitted): the quick slice first, then the full sets
ROWS = [
    Row("baseline", "baseline (no compression)", generate=True, scopes=ALL),
    Row("int8-g64", "8-bit weights + cache, g64", _compress("both", 8, 64), generate=True),
    Row("w4-g64", "4-bit weights, g64 dim 0", _compress("w", 4, 64)),
    Row("kv4-g64", "4-bit cache, g64 (per token)", _compress("kv", 4, 64), generate=True, scopes=ALL),
    Row("w4kv4-g64", "4-bit weights + cache, g64", _compress("both", 4, 64), generate=True),
    Row("w4kv4s-g64", "4-bit-S: 4-bit both + sparsity 0.1, g64", _compress("both", 4, 64) + ["--attn-sparsity", "0.1"],
        generate=True),
    Row("w4-g64-d1", "4-bit weights, g64 dim 1", _compress("w", 4, 64, 1), scopes=ALL),
    Row("w4-g32-d0", "4-bit weights, g32 dim 0", _compress("w", 4, 32, 0)),
    Row("w4-g32-d1", "4-bit weights, g32 dim 1 (= the GGUF's Q4_1 blocks)", _compress("w", 4, 32, 1), scopes=ALL),
    # g128 cannot group SmolLM2's 576-wide inputs (576 = 4.5 x 128): g192, the next coarser
    # grouping that divides both of its input widths (576, 1536), stands in for it
    Row("w4-g192-d1", "4-bit weights, g192 dim 1", _compress("w", 4, 192, 1), scopes=NEW),
    Row("w3-g64-d1", "3-bit weights, g64 dim 1", _compress("w", 3, 64, 1), scopes=NEW),
    # one more bit by RTN: a reference point for the 4-bit methods' goal (issue 22)
    Row("w5-g64-d1", "5-bit weights, g64 dim 1", _compress("w", 5, 64, 1), scopes=NEW),
    Row("w4h-g64-d1", "4-bit weights, g64 dim 1, hqq", _compress("w", 4, 64, 1, "hqq"), scopes=NEW),
    Row("kv4h-g64", "4-bit cache, g64, hqq", _compress("kv", 4, 64, method="hqq"), scopes=NEW),
    Row("w4h-g192-d1", "4-bit weights, g192 dim 1, hqq", _compress("w", 4, 192, 1, "hqq"), scopes=NEW),
    Row("w4h-g32-d1", "4-bit weights, g32 dim 1, hqq", _compress("w", 4, 32, 1, "hqq"), scopes=NEW),
    Row("w3h-g64-d1", "3-bit weights, g64 dim 1, hqq", _compress("w", 3, 64, 1, "hqq"), scopes=NEW),
    # the KIVI grouping of the cache (keys per channel over 64 or 32 tokens), against kv4-g64 (per token)
    Row("kv4k-g64", "4-bit cache, g64, KIVI", _compress("kv", 4, 64, cache="kivi"), scopes=NEW),
    Row("kv4k-g32", "4-bit cache, g32, KIVI", _compress("kv", 4, 32, cache="kivi"), scopes=("quick",)),
    Row("w4g-g64-d1", "4-bit weights, g64 dim 1, gptq", _compress("w", 4, 64, 1, "gptq"), scopes=NEW),
    Row("w4g-g192-d1", "4-bit weights, g192 dim 1, gptq", _compress("w", 4, 192, 1, "gptq"), scopes=NEW),
    Row("w4g-g32-d1", "4-bit weights, g32 dim 1, gptq", _compress("w", 4, 32, 1, "gptq"), scopes=NEW),
    Row("w3g-g64-d1", "3-bit weights, g64 dim 1, gptq", _compress("w", 3, 64, 1, "gptq"), scopes=NEW),
]
ROW_BY_NAME = {r.name: r for r in ROWS}
# each row on its scopes: "lim" (the reference's protocol), "quick" (issue 22's slice), "full"
PLAN = [(r.name, scope) for scope in SCOPES_ORDER for r in ROWS if scope in r.scopes]
# RTN's row of a setting and the rows of the other methods on it, side by side in the report (issue 22)
METHOD_ROWS = [("w4-g32-d1", {"hqq": "w4h-g32-d1", "gptq": "w4g-g32-d1"}),
               ("w4-g64-d1", {"hqq": "w4h-g64-d1", "gptq": "w4g-g64-d1"}),
               ("w4-g192-d1", {"hqq": "w4h-g192-d1", "gptq": "w4g-g192-d1"}), ("kv4-g64", {"hqq": "kv4h-g64"}),
               ("w3-g64-d1", {"hqq": "w3h-g64-d1", "gptq": "w3g-g64-d1"})]


def json_path(row: str, scope: str, task: str) -> Path:
    return OUT / "json" / f"{row}__{scope}__{task}.json"


def command(row: Row, scope: str, task: str) -> list[str]:
    extra = ["--generate"] if row.generate and task == "lambada" and scope == "lim" else []
    extra += ["--score-as-decode"] if row.acts_in_decode else []
    return (["eval", "--task", task] + MODEL + BATCH[task] + row.flags + SCOPES[scope][task] + extra
            + ["--quiet", "--json", str(json_path(row.name, scope, task))])
