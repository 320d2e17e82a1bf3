"""``python -m plait.train``: the training entry point (what the local launcher starts on each rank)."""

import sys

from plait.train.cli import main

sys.exit(main())
