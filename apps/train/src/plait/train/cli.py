"""Command line: ``plait-train [train|plan|validate|show|list] [--recipe R] [--set a.b=v ...]``.

``train`` (the default) launches local ranks when not under torchrun, else trains on this rank.
``plan`` is a dry run on torch's fake process group: no ranks, no weights, just the layout.
``validate`` runs every check of the recipe against a world size (no ranks, nothing written),
``show`` prints the resolved recipe after overrides, ``list`` the shipped recipes.
A bad recipe prints one ``plait-train: error: ...`` line (under the local launcher once, naming its ranks) and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.train.config import Recipe

__all__ = ["entry", "main"]

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
    parser.add_argument(
        "--allow-imports",
        action="store_true",
        help="let the recipe import the 'pkg.mod:ATTR' paths it names (tp_plan, unit_modules): only for recipes you trust",
    )
    if command == "plan":
        parser.add_argument("--world-size", type=int, default=None, help="ranks to plan for (up to 16,384)")
        _auto_arguments(parser)
    if command == "validate":
        parser.add_argument(
            "--world-size", type=int, default=None, help="ranks to check for (default: launch.nproc_per_node)"
        )
    return parser


def _auto_arguments(parser: argparse.ArgumentParser) -> None:
    auto = parser.add_argument_group("plan --auto: search every layout on a cluster (docs/planner.md)")
    auto.add_argument("--auto", action="store_true", help="search layouts instead of planning the recipe's")
    auto.add_argument("--hf-config", default=None, help="a Hugging Face config.json to size the model from")
    auto.add_argument("--nodes", type=int, default=1)
    auto.add_argument("--gpus-per-node", type=int, default=8)
    auto.add_argument("--gpu", default="h100", help="GPU preset: h100 or h200 (SXM)")
    auto.add_argument("--memory-gib", type=float, default=None, help="override the preset's memory per GPU")
    auto.add_argument("--peak-tflops", type=float, default=None, help="override the preset's bf16 peak")
    auto.add_argument("--global-tokens", type=int, default=None, help="tokens per optimizer step (all ranks)")
    auto.add_argument("--seq-len", type=int, default=None, help="sequence length (default: data.seq_len)")
    auto.add_argument(
        "--consider",
        action="append",
        default=[],
        metavar="AXIS=N,...",
        help="also show the best layout with these sizes, e.g. pp=4,ep=8",
    )
    auto.add_argument("--top", type=int, default=5, help="candidates to print")
    auto.add_argument("--write", default=None, metavar="FILE", help="write the best layout as a recipe")


def _auto(recipe: Recipe, args: argparse.Namespace) -> str:
    from plait.planner import cluster
    from plait.train.plan_auto import auto_plan, parse_pin, shape_from_file, shape_of, write_recipe

    overrides = {
        k: v for k, v in (("memory_gib", args.memory_gib), ("peak_tflops", args.peak_tflops)) if v is not None
    }
    machine = cluster(args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node, **overrides)
    shape = shape_from_file(args.hf_config) if args.hf_config else shape_of(recipe)
    seq = args.seq_len or recipe.data.seq_len
    tokens = args.global_tokens or seq * machine.world_size
    text, result = auto_plan(
        shape,
        machine,
        global_tokens=tokens,
        seq_len=seq,
        considers=[parse_pin(c) for c in args.consider],
        top=args.top,
    )
    if args.write:
        if not result.candidates or not result.candidates[0].fits:
            raise ValueError(f"--write {args.write}: no layout fits, nothing written")
        text += "\n" + write_recipe(args.write, recipe, result.candidates[0].layout, machine)
    return text


def _fail(err: BaseException) -> int:
    from plait.train.errors import report

    return report(err)


def _load(args: argparse.Namespace) -> Recipe:
    """The recipe, its import paths allowed or refused, its run directory possible."""
    from plait.train.errors import UserError, check_run_dir, user_message
    from plait.train.imports import check_recipe_imports
    from plait.train.recipes import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except (UnicodeDecodeError, RecursionError, OSError) as err:
        raise UserError(f"recipe {args.recipe!r}: {user_message(err)}") from None
    check_recipe_imports(recipe, allow_imports=args.allow_imports)
    check_run_dir(recipe.run_dir)
    resume_from = recipe.checkpoint.resume_from
    if resume_from and not os.path.isdir(resume_from):
        raise UserError(
            f"checkpoint.resume_from {resume_from!r} is not a directory; name a step_ directory of a run's "
            "checkpoints/, or drop it to resume from the newest complete checkpoint"
        )
    return recipe


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

    recipe = load_recipe(args.recipe, args.overrides) if command == "show" else _load(args)
    if command == "show":
        print(yaml.safe_dump(to_dict(recipe), sort_keys=False), end="")
    elif command == "plan" and args.auto:
        print(_auto(recipe, args))
    elif command == "plan":
        if args.world_size is None:
            raise ValueError("plan needs --world-size N (or --auto to search layouts on a cluster)")
        from plait.train.plan import plan

        print(plan(recipe, args.world_size))
    else:
        world = args.world_size or recipe.launch.nproc_per_node
        if world < 1:
            raise ValueError(f"--world-size must be >= 1, got {world}")
        from plait.train.plan import validate

        print(validate(recipe, world))
    return 0


def entry() -> int:
    """The process entry point (``plait-train``, ``python -m plait.train``, ``uv run apps/train``).

    A ``train`` command outside a launcher starts the server its local ranks are forked from
    first, so that the server's imports run while :func:`main` checks the recipe.
    """
    import plait.train.quiet_logs  # noqa: F401 - before anything imports torchao
    from plait.train.launch import under_launcher

    command = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in _COMMANDS else "train"
    if command == "train" and not under_launcher():
        from plait.train.rank_server import start_rank_server

        start_rank_server()
    return main()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the process exit code."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    command = args_in[0] if args_in and args_in[0] in _COMMANDS else "train"
    rest = args_in[1:] if args_in and args_in[0] in _COMMANDS else args_in
    args = _parser(command).parse_args(rest)
    if command == "list":
        return _list()
    if command != "train":
        from plait.train.errors import UserError

        try:
            return _inspect(command, args)
        except (ValueError, TypeError, UserError) as err:
            return _fail(err)

    from plait.train.errors import Stopped, UserError
    from plait.train.launch import defer_sigterm, launch_local, under_launcher

    launched = under_launcher()
    if launched:
        from plait.train.lifecycle import die_with_launcher

        die_with_launcher()
    with defer_sigterm():
        try:
            from plait.train.launch import check_nproc
            from plait.train.setup import check_recipe

            recipe = _load(args)
            world = int(os.environ.get("WORLD_SIZE", "1")) if launched else recipe.launch.nproc_per_node
            config = check_recipe(recipe, world)
            if not launched:
                launch = recipe.launch
                check_nproc(launch.nproc_per_node, recipe.train.device, oversubscribe=launch.oversubscribe)
        except (ValueError, TypeError, UserError) as err:
            return _fail(err)
    if not launched:
        return launch_local(
            main,
            args_in,
            nproc_per_node=recipe.launch.nproc_per_node,
            max_restarts=recipe.launch.max_restarts,
        )

    from plait.train.errors import report_internal
    from plait.train.trainer import SetupError, run

    try:
        run(recipe, config)
    except (SetupError, UserError, Stopped) as err:
        return _fail(err)
    except Exception as err:  # internal: its traceback, printed once and kept in the run directory
        return report_internal(err, recipe.run_dir)
    return 0
