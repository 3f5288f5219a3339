"""benches/copy_support/bf16_bits.py, which decides what benches/refit_peer.py says about a peer's
bytes: a NaN whose payload changed is told apart from misplaced or altered bytes. No torch needed."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from copy_support.bf16_bits import EXACT, NAN_PAYLOADS, WRONG, is_bf16_nan, verdict  # noqa: E402


def signed(bits):
    """A 16-bit pattern as torch's int16 tolist() gives it."""
    return bits - (1 << 16) if bits >= 1 << 15 else bits


class Bf16Bits(unittest.TestCase):
    def test_nan_patterns(self):
        for bits in (0x7F81, 0x7FC0, 0x7FFF, 0xFFC1, 0xFF81):
            self.assertTrue(is_bf16_nan(bits), hex(bits))
            self.assertTrue(is_bf16_nan(signed(bits)), hex(bits))
        for bits in (0x7F80, 0xFF80, 0x0000, 0x8000, 0x3F80, 0x7F7F, 0x0001):
            self.assertFalse(is_bf16_nan(bits), hex(bits))
            self.assertFalse(is_bf16_nan(signed(bits)), hex(bits))

    def test_no_difference_is_exact(self):
        self.assertEqual(verdict([]), EXACT)
        self.assertEqual(verdict(iter([])), EXACT)

    def test_canonicalized_nans_are_told_apart_from_wrong_bytes(self):
        canonical = 0x7FC0
        self.assertEqual(verdict([(canonical, 0x7F81), (signed(0xFFC0), signed(0xFFC1))]), NAN_PAYLOADS)
        # A NaN turned into a number, a number changed, or a number turned into a NaN: wrong bytes.
        self.assertEqual(verdict([(canonical, 0x7F81), (0x3F80, 0x7F81)]), WRONG)
        self.assertEqual(verdict([(0x3F81, 0x3F80)]), WRONG)
        self.assertEqual(verdict([(canonical, 0x3F80)]), WRONG)
        # Infinity is no NaN: infinity for a NaN is a wrong byte.
        self.assertEqual(verdict([(0x7F80, 0x7F81)]), WRONG)


if __name__ == "__main__":
    unittest.main()
