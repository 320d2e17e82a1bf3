"""``python tools/gpu_check [--dry-run]``: see README.md (``tools/gpu_check/run`` picks the Python)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
