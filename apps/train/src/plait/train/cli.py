"""Command line: ``plait-train [train] [--recipe R] [--set a.b=v ...]`` and ``plait-train plan ...``.

``train`` (the default) launches local ranks when not under torchrun, else trains on this rank.
``plan`` is a dry run on torch's fake process group: no ranks, no weights, just the layout.
A bad recipe prints one ``plait-train: error: ...`` line (on every rank) and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

_COMMANDS = ("train", "plan")


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"plait-train {command}",
        description="Train a model with plait (default recipe: FSDP2 + TP 2 + SP + AC on 4 local ranks)."
        if command == "train"
        else "Dry run: per-rank memory, FSDP units, TP placements and communication per step.",
        epilog="Dry run instead: plait-train plan --recipe R --world-size W" if command == "train" else None,
    )
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
    return parser


def _fail(err: BaseException) -> int:
    message = " ".join(str(err).split())
    print(f"plait-train: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    command = args_in[0] if args_in and args_in[0] in _COMMANDS else "train"
    rest = args_in[1:] if args_in and args_in[0] in _COMMANDS else args_in
    args = _parser(command).parse_args(rest)

    from plait.train.launch import defer_sigterm, launch_local, under_launcher

    launched = under_launcher()
    with defer_sigterm():
        try:
            from plait.train.recipes import load_recipe
            from plait.train.setup import check_recipe

            recipe = load_recipe(args.recipe, args.overrides)
            if command == "plan":
                from plait.train.plan import plan

                print(plan(recipe, args.world_size))
                return 0
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
