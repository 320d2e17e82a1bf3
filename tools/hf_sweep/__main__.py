"""``uv run tools/hf_sweep [...]``: every transformers causal-LM family with a TP plan, under plait's TP."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_sweep.cli import main

if __name__ == "__main__":
    sys.exit(main())
