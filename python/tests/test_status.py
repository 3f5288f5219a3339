"""Statuses, error messages and the log sink."""

import threading
import unittest

import refit
from refit._lib import check, last_error_message, lib


class StatusTest(unittest.TestCase):
    def test_version_matches_library(self):
        self.assertRegex(refit.version(), r"^\d+\.\d+\.\d+$")
        self.assertEqual(refit.abi_version(), refit.ABI_VERSION)

    def test_status_names_come_from_library(self):
        self.assertEqual(refit.Status.SUCCESS, 0)
        self.assertEqual(refit.Status.INVALID_ARGUMENT, 1)
        for status in refit.Status:
            self.assertEqual(lib.refit_status_string(status).decode(), "REFIT_STATUS_" + status.name)
        self.assertEqual(lib.refit_status_string(len(refit.Status)), b"REFIT_STATUS_UNKNOWN")
        self.assertEqual(lib.refit_status_string(-1), b"REFIT_STATUS_UNKNOWN")

    def test_check_passes_success_and_raises_the_rest(self):
        check(0)
        for status in list(refit.Status)[1:]:
            with self.assertRaises(refit.RefitError) as caught:
                check(int(status))
            self.assertIs(caught.exception.status, status)
            self.assertTrue(str(caught.exception).startswith(status.name + ": "))

    def test_failing_call_raises_with_the_library_message(self):
        with self.assertRaises(refit.RefitError) as caught:
            refit.set_log_callback(lambda level, message: None, level=9)
        self.assertEqual(caught.exception.status, refit.Status.INVALID_ARGUMENT)
        self.assertIn("level 9", caught.exception.message)
        self.assertEqual(caught.exception.message, last_error_message())

    def test_success_leaves_the_last_error_and_threads_keep_their_own(self):
        with self.assertRaises(refit.RefitError):
            refit.Table.decode(b"not a table")
        mine = last_error_message()
        self.assertNotEqual(mine, "")
        refit.Table().close()  # a successful call
        self.assertEqual(last_error_message(), mine)

        seen = {}

        def other_thread():
            seen["before"] = last_error_message()
            try:
                refit.Group([], backend=refit.Backend.HOST)
            except refit.RefitError as error:
                seen["error"] = error

        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        self.assertEqual(seen["before"], "")
        self.assertEqual(seen["error"].status, refit.Status.EMPTY_DEVICE_LIST)
        self.assertEqual(last_error_message(), mine)

    def test_log_callback_receives_records_and_can_be_replaced(self):
        def open_scope_then_destroy():
            # Destroying a group with a scope left open logs a warning (level 2).
            group = refit.Group([0], backend=refit.Backend.HOST)
            group.enter()
            group.close()

        first, second = [], []
        try:
            refit.set_log_callback(lambda level, message: first.append((level, message)), level=5)
            open_scope_then_destroy()
            refit.set_log_callback(lambda level, message: second.append((level, message)), level=2)
            open_scope_then_destroy()
        finally:
            refit.set_log_callback(None)
        self.assertTrue(any(level == 2 and "scope" in message for level, message in first), first)
        self.assertEqual(len(second), 1, second)
        self.assertEqual(second[0][0], 2)
        self.assertEqual(len([record for record in first if record[0] == 2]), 1, first)


if __name__ == "__main__":
    unittest.main()
