"""The docs a new user copies from: the wheel install command and the recipe table stay complete."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _workspace_dependencies() -> dict[str, set[str]]:
    """Each workspace package's name -> the workspace packages it depends on directly."""
    projects = {}
    for file in [*REPO.glob("packages/*/pyproject.toml"), *REPO.glob("apps/*/pyproject.toml")]:
        project = tomllib.loads(file.read_text())["project"]
        projects[project["name"]] = [
            re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0] for d in project["dependencies"]
        ]
    return {name: {d for d in deps if d in projects} for name, deps in projects.items()}


def _closure(names: set[str], deps: dict[str, set[str]]) -> set[str]:
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(deps[name])
    return found


def _wheel_install_command() -> str:
    section = (REPO / "docs/installation.md").read_text().split("## As wheels", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return next(line for line in block.splitlines() if "uv pip install" in line)


def test_the_wheel_install_command_names_every_workspace_package_it_needs():
    deps = _workspace_dependencies()
    assert {"plait-train", "plait-mesh", "plait-cp"} <= deps.keys()
    named = {f"plait-{m}" for m in re.findall(r"dist/plait_(\w+)-\*\.whl", _wheel_install_command())}
    assert named <= deps.keys(), named - deps.keys()
    assert "plait-train" in named
    missing = _closure(named, deps) - named
    assert not missing, f"docs/installation.md's wheel install lacks {sorted(missing)} (dependencies of it)"


def test_the_apps_readme_recipe_table_lists_every_shipped_recipe():
    readme = (REPO / "apps/train/README.md").read_text()
    table = readme.split("## Recipes", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE)
    shipped = sorted(p.stem for p in (REPO / "apps/train/src/plait/train/shipped_recipes").glob("*.yaml"))
    assert sorted(listed) == shipped
