"""The kvdump package installs into whatever Python runs it, and its examples do not depend on
which interpreter comes first on PATH (issue: a pyenv python3 without numpy came first, and the
only advice was "use /usr/bin/python3").

  - pyproject.toml declares the writer's dependencies (numpy, h5py), so `python3 -m pip install
    ./python` brings them into that interpreter;
  - pip installs the package from the source tree with this interpreter (offline: --no-deps
    --no-index, into a temporary target) and it imports from there;
  - the example writes a dump when run by this interpreter from any directory, and neither the
    examples nor the package README name a fixed interpreter path.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy  # noqa: F401
    import h5py  # noqa: F401

    MISSING = None
except ImportError as error:  # this interpreter lacks the dependencies pip would install
    MISSING = f"{sys.executable} cannot import {error.name} (python3 -m pip install ./python)"

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
EXAMPLES = os.path.join(PYTHON_DIR, "examples")


def clean_environment():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


class PackagingTest(unittest.TestCase):
    def test_dependencies_declared(self):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            self.skipTest("tomllib needs Python 3.11")
        with open(os.path.join(PYTHON_DIR, "pyproject.toml"), "rb") as f:
            project = tomllib.load(f)["project"]
        names = {dep.split(">")[0].split("=")[0].split("<")[0].strip().lower()
                 for dep in project["dependencies"]}
        self.assertTrue({"numpy", "h5py"} <= names, project["dependencies"])
        self.assertIn("requires-python", project)

    @unittest.skipIf(MISSING, MISSING)
    def test_pip_installs_into_this_interpreter(self):
        probe = subprocess.run([sys.executable, "-c", "import setuptools, pip"],
                               capture_output=True)
        if probe.returncode != 0:
            self.skipTest(f"{sys.executable} has no pip or setuptools")
        with tempfile.TemporaryDirectory() as target, tempfile.TemporaryDirectory() as work:
            # A copy: setuptools builds in the source folder (build/, *.egg-info).
            source = os.path.join(work, "python")
            shutil.copytree(PYTHON_DIR, source,
                            ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
            build = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                 "--no-build-isolation", "--disable-pip-version-check", "--target", target,
                 source],
                capture_output=True, text=True, cwd=work, env=clean_environment())
            self.assertEqual(build.returncode, 0, build.stdout + build.stderr)
            env = clean_environment()
            env["PYTHONPATH"] = target
            where = subprocess.run([sys.executable, "-c", "import kvdump; print(kvdump.__file__)"],
                                   capture_output=True, text=True, cwd=work, env=env)
            self.assertEqual(where.returncode, 0, where.stderr)
            self.assertTrue(where.stdout.strip().startswith(target), where.stdout)

    @unittest.skipIf(MISSING, MISSING)
    def test_example_runs_with_this_interpreter_from_anywhere(self):
        with tempfile.TemporaryDirectory() as work:
            out = os.path.join(work, "example.h5")
            run = subprocess.run([sys.executable, os.path.join(EXAMPLES, "write_synthetic_dump.py"),
                                  out], capture_output=True, text=True, cwd=work,
                                 env=clean_environment())
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertTrue(os.path.getsize(out) > 0)
            binary = os.environ.get("KVAUDIT_BINARY")
            if binary and os.path.exists(binary):
                info = subprocess.run([binary, "info", out], capture_output=True, text=True)
                self.assertEqual(info.returncode, 0, info.stdout + info.stderr)

    def test_no_fixed_interpreter_in_examples_or_readme(self):
        files = [os.path.join(EXAMPLES, name) for name in sorted(os.listdir(EXAMPLES))
                 if name.endswith(".py")]
        files.append(os.path.join(PYTHON_DIR, "README.md"))
        for path in files:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    self.assertNotIn("/usr/bin/python", line, f"{path}:{number}")


if __name__ == "__main__":
    unittest.main()
