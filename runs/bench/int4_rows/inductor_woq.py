"""Whether torch.compile's CPU GEMM template for int4 weights (Inductor's AMX micro-kernel for
`_weight_int4pack_mm_for_cpu`, chosen by max-autotune) would multiply a decode step's few rows an
expert faster than the ATen kernel, and on what terms: one OLMoE expert's 1024 x 2048 weight,
4/5/8/16 rows, compiled (a) with the weight an input of the compiled function, (b) with the weight
a frozen constant of a module (inductor freezing), as the template requires. Prints Inductor's own
autotune table on stderr, then the compile time, the largest difference from the ATen kernel
relative to the output's scale, and the median call of each (us).

    python runs/bench/int4_rows/inductor_woq.py
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config  # noqa: PLC2701 (the bench studies Inductor's own switches)

from flexgen_helm.memory.machine import machine_label

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from record import median_seconds

N, K, GROUP = 1024, 2048, 64
ROWS = (4, 5, 8, 16)


class FrozenExpert(torch.nn.Module):
    def __init__(self, packed: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)


def aten_mm(x, packed, scales):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)


def main() -> None:
    torch.manual_seed(0)
    inductor_config.max_autotune = True
    inductor_config.max_autotune_gemm_backends = "CPP,ATEN"
    inductor_config.fx_graph_cache = False  # each mode compiles afresh
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 2)
    scales = (torch.rand(K // GROUP, N, 2) * 0.02).bfloat16().contiguous()
    print(f"# {machine_label()}, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; a {N} x {K} weight, groups of {GROUP}")
    with torch.no_grad():
        for mode in ("weight an input", "weight frozen"):
            inductor_config.freezing = mode == "weight frozen"
            if mode == "weight frozen":
                call = torch.compile(FrozenExpert(packed, scales).eval(), dynamic=False)
            else:
                compiled = torch.compile(aten_mm, dynamic=False)
                call = functools.partial(compiled, packed=packed, scales=scales)
            for rows in ROWS:
                x = torch.randn(rows, K).bfloat16()
                start = time.perf_counter()
                got = call(x)
                compile_s = time.perf_counter() - start
                want = aten_mm(x, packed, scales)
                rel = float((got.float() - want.float()).abs().max() / want.float().abs().max())
                aten_us = 1e6 * median_seconds(functools.partial(aten_mm, x, packed, scales), 200)
                compiled_us = 1e6 * median_seconds(functools.partial(call, x), 200)
                print(f"{mode} | rows {rows} | first call {compile_s:.1f} s | max diff / max |out| {rel:.1e} | "
                      f"ATen {aten_us:.0f} us | compiled {compiled_us:.0f} us", flush=True)


if __name__ == "__main__":
    main()
