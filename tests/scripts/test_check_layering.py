"""scripts/check_layering.py finds an upward include and an include cycle, and passes this tree."""
import pathlib
import subprocess
import sys
import tempfile
import unittest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_layering.py"


def run(root=None):
    args = [sys.executable, str(SCRIPT)] + ([str(root)] if root else [])
    return subprocess.run(args, capture_output=True, text=True)


class CheckLayeringTest(unittest.TestCase):
    def write(self, root, path, *includes):
        file = root / path
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("".join(f'#include "{target}"\n' for target in includes))

    def test_this_tree_is_clean(self):
        result = run()
        self.assertEqual(result.returncode, 0, result.stdout)

    def test_an_upward_include_fails_and_is_named(self):
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            self.write(root, "src/core/codec.hpp", "src/verdict/policy.hpp")
            self.write(root, "src/verdict/policy.hpp", "src/core/codec.hpp")
            result = run(root)
        self.assertEqual(result.returncode, 1)
        self.assertIn("src/core/codec.hpp:1: includes src/verdict/policy.hpp (core -> verdict)",
                      result.stdout)
        self.assertIn("include cycle", result.stdout)

    def test_a_downward_include_passes(self):
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            self.write(root, "src/cli/main.cpp", "src/replay/replay.hpp")
            self.write(root, "src/replay/replay.hpp", "src/core/result.hpp")
            self.write(root, "src/core/result.hpp")
            result = run(root)
        self.assertEqual(result.returncode, 0, result.stdout)


if __name__ == "__main__":
    unittest.main()
