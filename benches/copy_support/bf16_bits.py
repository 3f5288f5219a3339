"""What a difference between copied bf16 bits and their source is, for the peers' byte checks.

torch's `_foreach_copy_` on CUDA takes a fast path when every destination/source pair is dense
with the same sizes and strides: it loads each bf16 element as a float and stores it back
(`UnaryOpFunctor` with `Copy<opmath_t, opmath_t>`), and the float -> bf16 conversion replaces a
NaN's payload with the canonical NaN. Random source bits hold NaNs (about 1 element in 260), so
the sampled check sees differences that are not misplaced bytes. `verdict` tells the two apart;
`foreach_copy_nan_repro.py` beside this file is the minimal reproduction.
"""

EXACT = "yes"
NAN_PAYLOADS = "NaN payloads replaced, every other bit right"
WRONG = "NO (bytes differ beyond NaN payloads)"


def is_bf16_nan(bits):
    """Whether the 16-bit pattern `bits` (an int, signed or not) is a bf16 NaN: exponent all ones,
    mantissa not zero."""
    bits &= 0xFFFF
    return (bits & 0x7F80) == 0x7F80 and (bits & 0x007F) != 0


def verdict(differing):
    """`differing`: (destination bits, source bits) of every element that differs, over every
    checked slice. EXACT when none differ, NAN_PAYLOADS when each differing element is a NaN on both
    sides, WRONG otherwise."""
    pairs = list(differing)
    if not pairs:
        return EXACT
    if all(is_bf16_nan(dst) and is_bf16_nan(src) for dst, src in pairs):
        return NAN_PAYLOADS
    return WRONG
