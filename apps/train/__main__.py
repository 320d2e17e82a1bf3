"""``uv run apps/train`` (and ``torchrun ... apps/train``): the training entry point."""

import sys

from plait.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
