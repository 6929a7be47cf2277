"""RotaryAt.apply (half by half) against the formula it replaced (a rotated copy), at a
few-shot prefill's shapes in float32: bit for bit the same, and the time of each.

    python runs/bench/rotary_halves/micro.py
"""

from __future__ import annotations

import time

import torch

from flexgen_helm.models.rotary import RotaryAt

BATCH, HEADS, POSITIONS, HEAD_DIM = 64, 9, 28, 64


def rotated_copy(at: RotaryAt, x: torch.Tensor) -> torch.Tensor:
    """The formula before: x * cos + rotate_half(x) * sin."""
    half = at.cos.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * at.cos + rotated * at.sin


def best_ms(fn, x: torch.Tensor, repeats: int = 20) -> float:
    for _ in range(5):
        fn(x)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(x)
        times.append((time.perf_counter() - t0) / repeats)
    return min(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(BATCH, HEADS, POSITIONS, HEAD_DIM)
    angles = torch.randn(BATCH, 1, POSITIONS, HEAD_DIM // 2)
    angles = torch.cat((angles, angles), dim=-1)
    at = RotaryAt(angles.cos(), angles.sin())
    print("bit for bit the same:", torch.equal(at.apply(x), rotated_copy(at, x)))
    print(f"rotated copy {best_ms(lambda t: rotated_copy(at, t), x):.3f} ms, "
          f"half by half {best_ms(at.apply, x):.3f} ms")


if __name__ == "__main__":
    main()
