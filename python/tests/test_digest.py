"""refit.digest / Group.digest and refit.digest_many / Group.digest_many on the host backend: the value
equals the digest computed here from the header's definition (bit by bit, modulo g) at every
alignment, 0 bytes at any address (the last one included) digest to 1; each of many ranges digests as
it does alone; the same bytes elsewhere give the same value and a flipped bit does not; bad arguments
raise with their status and a message naming them."""

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
        # Issue 26, 6: 0 bytes at the last address was INVALID_ARGUMENT "runs past the end".
        for addr in (2**64 - 1, 2**64 - 16, 1):
            self.assertEqual(self.group.digest(0, addr, 0), 1, hex(addr))

    def test_many_ranges_digest_as_each_does_alone(self):
        ranges = [(self.base + offset, length) for offset in range(0, 16, 3) for length in (0, 1, 15, 16, 17, 100, 180)]
        ranges += [(2**64 - 1, 0), (self.base + 7, 64), (self.base + 7, 64)]
        got = self.group.digest_many(1, ranges, stream=self.group.stream(1))
        self.assertEqual(len(got), len(ranges))
        for (addr, length), value in zip(ranges, got):
            self.assertEqual(value, self.group.digest(1, addr, length), (addr - self.base, length))
            if addr != 2**64 - 1:
                self.assertEqual(value, reference(self.data[addr - self.base : addr - self.base + length]))
        self.assertEqual(got[-3], 1)
        self.assertEqual(refit.digest_many(self.group, 0, ranges[:5]), got[:5])
        self.assertEqual(self.group.digest_many(0, []), [])
        self.assertEqual(self.group.digest_many(0, iter(ranges[:2])), got[:2])

    def test_many_bad_arguments(self):
        good = (self.base, 8)
        cases = [
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(2, [good]), "rank 2"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(2, []), "rank 2"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(0, [good, (0, 8)]), "range 1: address is 0"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(0, [good, (2**64 - 4, 8)]), "range 1: range of 8"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(0, [good, (self.base, -1)]), "ranges[1] length"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(0, [good, 5]), "ranges[1] must be an (addr,"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(0, None), "ranges must be a sequence"),
            (Status.INVALID_ARGUMENT, lambda: self.group.digest_many(0, [good], stream=0x3039), "host stream"),
            (Status.INVALID_ARGUMENT, lambda: refit.digest_many(object(), 0, [good]), "group must be a refit group"),
        ]
        for status, call, words in cases:
            with self.assertRaises(RefitError, msg=words) as caught:
                call()
            self.assertEqual(caught.exception.status, status)
            self.assertIn(words, str(caught.exception))

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
