"""A longer search for inputs that crash potluck (issue #14).

Runs the property tests of ``tests/test_input_validation.py`` (every ``generate`` option and
input, every config.toml value) with many more examples than CI does::

    nice -n 19 .venv/bin/python tests/fuzz_cli.py [EXAMPLES]    # default 500
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    examples = sys.argv[1] if len(sys.argv) > 1 else "500"
    env = {**os.environ, "POTLUCK_FUZZ_EXAMPLES": examples}
    test_file = Path(__file__).with_name("test_input_validation.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "--hypothesis-show-statistics", "-k", "any_input or config_values",
           str(test_file)]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
