"""``python -m plait.train``: the training entry point (what the local launcher starts on each rank)."""

import sys

from plait.train.cli import main
from plait.train.imports import drop_implicit_cwd

drop_implicit_cwd()  # before anything a recipe names is imported
sys.exit(main())
