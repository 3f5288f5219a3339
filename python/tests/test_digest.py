"""refit.digest / Group.digest on the host backend: the value equals the digest computed here from the
header's definition (bit by bit, modulo g) at every alignment; the same bytes elsewhere give the same
value and a flipped bit does not; bad arguments raise with their status."""

import ctypes
import unittest

import refit
from refit import Backend, Group, RefitError, Status

POLY = 0x41AA24523C3D140F


def reference(data):
    """The header's definition: sum of x^k over the set bits k, plus x^(8 len), modulo g."""
    total, power = 0, 1
    bits = [(byte >> k) & 1 for byte in data for k in range(8)] + [1]
    for bit in bits:
        if bit:
            total ^= power
        power = ((power << 1) & (2**64 - 1)) ^ (POLY if power >> 63 else 0)
    return total


class DigestTest(unittest.TestCase):
    def setUp(self):
        self.group = Group([0, 1], backend=Backend.HOST)
        self.data = bytes((i * 37 + 11) % 256 for i in range(200))
        self.buffer = (ctypes.c_uint8 * len(self.data)).from_buffer_copy(self.data)
        self.base = ctypes.addressof(self.buffer)

    def tearDown(self):
        self.group.close()

    def test_matches_the_definition_at_every_alignment(self):
        for offset in range(0, 16, 5):
            for length in (0, 1, 8, 15, 16, 17, 100, 180):
                got = self.group.digest(1, self.base + offset, length)
                self.assertEqual(got, reference(self.data[offset : offset + length]), (offset, length))
        self.assertEqual(refit.digest(self.group, 0, 0, 0), 1)

    def test_same_bytes_same_digest_and_a_flipped_bit_changes_it(self):
        other = (ctypes.c_uint8 * 64).from_buffer_copy(self.data[7:71])
        original = self.group.digest(0, self.base + 7, 64)
        self.assertEqual(self.group.digest(0, ctypes.addressof(other), 64), original)
        other[30] ^= 0x80
        self.assertNotEqual(self.group.digest(0, ctypes.addressof(other), 64), original)

    def test_bad_arguments(self):
        cases = [
            (Status.INVALID_ARGUMENT, lambda: self.group.digest(2, self.base, 8), "rank 2"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest(0, 0, 8), "address is 0"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest(0, 2**64 - 4, 8), "past the end"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest(0, self.base, -1), "length"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest(0, self.base, 8, stream=0x3039), "host stream"),
        ]
        for status, call, words in cases:
            with self.assertRaises(RefitError) as caught:
                call()
            self.assertEqual(caught.exception.status, status)
            self.assertIn(words, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
