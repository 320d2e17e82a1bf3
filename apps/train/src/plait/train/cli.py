"""Command line: ``plait-train [train|plan|validate|show|list] [--recipe R] [--set a.b=v ...]``.

``train`` (the default) launches local ranks when not under torchrun, else trains on this rank.
``plan`` is a dry run on torch's fake process group: no ranks, no weights, just the layout.
``validate`` runs every check of the recipe against a world size (no ranks, nothing written),
``show`` prints the resolved recipe after overrides, ``list`` the shipped recipes.
A bad recipe prints one ``plait-train: error: ...`` line (on every rank) and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

_COMMANDS = ("train", "plan", "validate", "show", "list")
_DESCRIPTIONS = {
    "train": "Train a model with plait (default recipe: FSDP2 + TP 2 + SP + AC on 4 local ranks).",
    "plan": "Dry run: per-rank memory, FSDP units, TP placements and communication per step.",
    "validate": "Check a recipe against a world size without starting ranks: exit 0 if it would start, else 2.",
    "show": "Print the resolved recipe (defaults, file and --set overrides) as YAML.",
    "list": "List the shipped recipes, one line each.",
}


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"plait-train {command}",
        description=_DESCRIPTIONS[command],
        epilog="Other commands: plait-train {plan,validate,show,list} --help" if command == "train" else None,
    )
    if command == "list":
        return parser
    parser.add_argument("--recipe", default=None, help="YAML recipe path or a shipped recipe name")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.steps=10 (value parsed as YAML)",
    )
    if command == "plan":
        parser.add_argument("--world-size", type=int, required=True, help="ranks to plan for (up to 16,384)")
    if command == "validate":
        parser.add_argument(
            "--world-size", type=int, default=None, help="ranks to check for (default: launch.nproc_per_node)"
        )
    return parser


def _fail(err: BaseException) -> int:
    message = " ".join(str(err).split())
    print(f"plait-train: error: {message}", file=sys.stderr, flush=True)
    return 2


def _summary_line(text: str) -> str:
    """A recipe's first comment line (what it is), without the ``#``."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return "(no description)"


def _list() -> int:
    from plait.train.recipes import RECIPES_DIR

    files = sorted(RECIPES_DIR.glob("*.yaml"))
    recipes = {f.stem: _summary_line(f.read_text()) for f in files}
    width = max((len(name) for name in recipes), default=0)
    for name, summary in recipes.items():
        print(f"{name:<{width}}  {summary}")
    return 0


def _inspect(command: str, args: argparse.Namespace) -> int:
    """``plan``, ``validate`` and ``show``: no ranks started."""
    import yaml

    from plait.train.config import to_dict
    from plait.train.recipes import load_recipe
    from plait.train.setup import check_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if command == "show":
        print(yaml.safe_dump(to_dict(recipe), sort_keys=False), end="")
    elif command == "plan":
        from plait.train.plan import plan

        print(plan(recipe, args.world_size))
    else:
        world = args.world_size or recipe.launch.nproc_per_node
        if world < 1:
            raise ValueError(f"--world-size must be >= 1, got {world}")
        check_recipe(recipe, world)
        print(f"recipe {recipe.name}: ok on {world} rank(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    command = args_in[0] if args_in and args_in[0] in _COMMANDS else "train"
    rest = args_in[1:] if args_in and args_in[0] in _COMMANDS else args_in
    args = _parser(command).parse_args(rest)
    if command == "list":
        return _list()
    if command != "train":
        try:
            return _inspect(command, args)
        except (ValueError, TypeError) as err:
            return _fail(err)

    from plait.train.launch import defer_sigterm, launch_local, under_launcher

    launched = under_launcher()
    with defer_sigterm():
        try:
            from plait.train.recipes import load_recipe
            from plait.train.setup import check_recipe

            recipe = load_recipe(args.recipe, args.overrides)
            world = int(os.environ.get("WORLD_SIZE", "1")) if launched else recipe.launch.nproc_per_node
            config = check_recipe(recipe, world)
        except (ValueError, TypeError) as err:
            return _fail(err)
    if not launched:
        return launch_local(
            args_in, nproc_per_node=recipe.launch.nproc_per_node, max_restarts=recipe.launch.max_restarts
        )

    from plait.train.trainer import SetupError, run

    try:
        run(recipe, config)
    except SetupError as err:
        return _fail(err)
    return 0
