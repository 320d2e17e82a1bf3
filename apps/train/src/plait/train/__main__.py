"""``python -m plait.train``: the training entry point (also what each rank of a ``torchrun`` job runs)."""

import sys

from plait.train.cli import entry
from plait.train.imports import drop_implicit_cwd

drop_implicit_cwd()  # before anything a recipe names is imported
sys.exit(entry())
