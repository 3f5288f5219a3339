"""The README's code blocks that name an example file (```c examples/c/first.c) are that file, so the
programs CI builds and runs (packaging/check.sh) are the ones readers copy; docs/api.md has a row for
every call of include/refit.h."""

import re
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ReadmeTest(unittest.TestCase):
    def test_named_code_blocks_match_their_files(self):
        readme = (ROOT / "README.md").read_text()
        blocks = re.findall(r"^```\w+ (\S+)\n(.*?)^```$", readme, re.MULTILINE | re.DOTALL)
        named = {path for path, _ in blocks}
        for path in ("examples/c/first.c", "examples/cpp/first.cpp", "examples/python/first.py"):
            self.assertIn(path, named)
        for path, text in blocks:
            self.assertEqual(text, (ROOT / path).read_text(), f"README's block of {path} differs from the file")

    def test_every_call_of_the_header_has_a_row_in_the_api_page(self):
        header = (ROOT / "include" / "refit.h").read_text()
        calls = set(re.findall(r"^\S[^(;]*?\b(refit_[a-z0-9_]+)\(", header, re.MULTILINE))
        self.assertIn("refit_group_rank_of", calls)
        rows = [line for line in (ROOT / "docs" / "api.md").read_text().splitlines() if line.startswith("| `refit_")]
        first_cells = set()
        for row in rows:
            first_cells.update(re.findall(r"`(refit_[a-z0-9_]+)`", row.split(" | ")[0]))
        self.assertEqual(sorted(calls - first_cells), [], "calls of refit.h without a row in docs/api.md")
        self.assertEqual(sorted(first_cells - calls), [], "rows of docs/api.md naming no call of refit.h")


if __name__ == "__main__":
    unittest.main()
