"""``uv run apps/train`` (and ``torchrun ... apps/train``): the training entry point."""

import sys

from plait.train.cli import entry

if __name__ == "__main__":
    sys.exit(entry())
