"""How large an elementwise pass over a prefill's activations may be before the CPU takes it
a piece at a time (models/norms.py by rows, models/rotary.py by positions): whole, its float32
copies stream through memory several times; in pieces of PIECE_ELEMENTS they stay in the
core's cache. Inputs of up to PIECED_FROM elements fit the cache whole, where pieces would
only add calls. Measured on a 2-core AVX512-BF16 EPYC, alone (runs/bench/norm_pieces): RMSNorm
of an 8192 x 2048 bf16 input 12.6 ms whole, 6.1 ms in pieces (2.1x; float32 1.3x); rotary of
q of an 8 x 512-token prefill, 16 heads of 128, 12.7 ms whole, 6.8 ms in pieces (1.9x; float32
1.5x). Each row and position is computed alone, so the bits are the same.

A CPU decode step's attention over a large 16-bit cache takes its keys and values a piece of
PIECE_ELEMENTS at a time too (executor/attention._decode_by_positions), there summing the
pieces' products, so to float32's rounding."""

PIECE_ELEMENTS = 1 << 20
PIECED_FROM = 1 << 22


def pieced(numel: int, device_type: str) -> bool:
    """Whether a pass over `numel` elements on `device_type` goes a piece at a time: a CPU's
    cache is what the pieces are for."""
    return numel > PIECED_FROM and device_type == "cpu"
