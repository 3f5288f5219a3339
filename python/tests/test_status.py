import ctypes
import unittest

import refit
from refit._lib import check, lib


class StatusTest(unittest.TestCase):
    def test_version_matches_library(self):
        self.assertRegex(refit.version(), r"^\d+\.\d+\.\d+$")
        self.assertEqual(refit.abi_version(), 1)

    def test_status_names_come_from_library(self):
        self.assertEqual(refit.Status.SUCCESS, 0)
        self.assertEqual(refit.Status.INVALID_ARGUMENT, 1)
        self.assertIn("NOT_FOUND", refit.Status.__members__)

    def test_failing_call_raises_with_message(self):
        lib.refit_set_log_callback.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]
        with self.assertRaises(refit.RefitError) as caught:
            check(lib.refit_set_log_callback(9, None, None))
        self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
        self.assertIn("level 9", caught.exception.message)


if __name__ == "__main__":
    unittest.main()
