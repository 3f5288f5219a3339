"""Minimal reproduction: torch._foreach_copy_ does not keep the bits of bf16 NaNs on its CUDA fast
path (same-dtype, dense pairs with equal sizes and strides), where `copy_` keeps them.

Run on a machine with a CUDA GPU and torch: `python3 benches/copy_support/foreach_copy_nan_repro.py`.
Prints the source, `copy_`'s and `_foreach_copy_`'s bits; exits 1 when `_foreach_copy_` changed
them (reproduced), 0 when it kept them. Finite values and infinities keep their bits either way.
"""

import sys

import torch

PATTERNS = [0x7F81, 0x7FA5, 0xFFC1, 0xFF81, 0x7FC0, 0x3F80, 0xBF80, 0x7F80, 0x0001, 0x8000]


def bits(t):
    return [b & 0xFFFF for b in t.view(torch.int16).tolist()]


def main():
    src = torch.tensor([b - (1 << 16) if b >= 1 << 15 else b for b in PATTERNS], dtype=torch.int16, device="cuda")
    src = src.view(torch.bfloat16)
    by_copy, by_foreach = torch.empty_like(src), torch.empty_like(src)
    by_copy.copy_(src)
    torch._foreach_copy_([by_foreach], [src])
    torch.cuda.synchronize()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    print("source         ", " ".join(f"{b:04x}" for b in bits(src)))
    print("copy_          ", " ".join(f"{b:04x}" for b in bits(by_copy)))
    print("_foreach_copy_ ", " ".join(f"{b:04x}" for b in bits(by_foreach)))
    changed = bits(by_foreach) != bits(src)
    print("reproduced: _foreach_copy_ changed bf16 bits" if changed else "not reproduced: every bit kept")
    assert bits(by_copy) == bits(src), "copy_ changed bits too"
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
