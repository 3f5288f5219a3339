"""The README's code blocks that name an example file (```c examples/c/first.c) are that file, so the
programs CI builds and runs (packaging/check.sh) are the ones readers copy."""

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


if __name__ == "__main__":
    unittest.main()
