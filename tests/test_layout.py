"""The installed layout: one import name, the programs above the library, and a user's own
`train.py`, `serve.py` or `configs/` next to them never shadowing ours.

The top-level folders configs/, train/ and serve/ are what a user reads, copies and edits;
configs/ ships inside the wheel as `dspark_jax.configs`, the other two are not Python packages.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dspark_jax.cli import COMMANDS

REPO = Path(__file__).parents[1]
TOP_LEVEL_FOLDERS = ("configs", "train", "serve")
# A dotted module path into one of those folders, written as a string (e.g. for import_module).
_FOLDER_MODULE = re.compile(rf"(?:{'|'.join(TOP_LEVEL_FOLDERS)})(?:\.\w+)+")


def _library_modules() -> dict[str, Path]:
    """Every module the wheel installs, by import name; configs/ is `dspark_jax.configs`."""
    modules = {}
    for root, package in ((REPO / "dspark_jax", "dspark_jax"), (REPO / "configs", "configs")):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(("dspark_jax", *([package] if package == "configs" else []), *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _forbidden_imports(tree: ast.AST) -> list[str]:
    """Module names of the top-level folders that `tree` imports, or names as strings."""
    imported_by_name = {
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None))
        in ("import_module", "__import__")
        and node.args
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = id(node) in imported_by_name or _FOLDER_MODULE.fullmatch(node.value)
            names = [node.value] if named else []
        else:
            continue
        found += [n for n in names if n.split(".")[0] in TOP_LEVEL_FOLDERS]
    return sorted(found)


def test_the_import_check_catches_each_form():
    source = (
        "import train\nfrom configs.tiny import X\nimport serve.server as s\n"
        "importlib.import_module('configs')\nCOMMANDS = {'train': ('train.cli', 'help')}\n"
        "from . import sibling\nfrom dspark_jax.configs import qwen3\nSPLIT = 'train'\n"
    )
    assert _forbidden_imports(ast.parse(source)) == sorted(
        ["train", "configs.tiny", "serve.server", "configs", "train.cli"]
    )


def test_no_library_module_imports_the_top_level_folders():
    modules = _library_modules()
    assert {
        "dspark_jax.cli",
        "dspark_jax.configs.train_tiny",
        "dspark_jax.training.trainer",
    } <= set(modules)
    offenders = {
        name: found
        for name, path in sorted(modules.items())
        if (found := _forbidden_imports(ast.parse(path.read_text(), str(path))))
    }
    assert offenders == {}
    assert all(module.startswith("dspark_jax.cli.") for module, _ in COMMANDS.values())


def test_train_and_serve_are_launchers_not_packages():
    for folder in ("train", "serve"):
        files = sorted(p.name for p in (REPO / folder).iterdir())
        assert files and not any(name.endswith(".py") for name in files), files


# -- the wheel -----------------------------------------------------------------------------------
def _checkout_copy(dest: Path) -> Path:
    """The files a clean checkout of this tree has: tracked and unignored, no build leftovers."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = _checkout_copy(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q", "-w", str(out)],
        check=True,
    )
    (path,) = out.glob("*.whl")
    return path


def test_wheel_has_one_top_level_name_and_ships_the_configs(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["dspark_jax"]
    assert {n.split("/")[0] for n in names} == {"dspark_jax", top_level.split("/")[0]}
    configs = {f"dspark_jax/configs/{p.name}" for p in (REPO / "configs").glob("*.py")}
    assert "dspark_jax/configs/__init__.py" in configs and configs <= names
    library = {str(p.relative_to(REPO)) for p in (REPO / "dspark_jax").rglob("*") if p.is_file()}
    assert {n for n in library if "__pycache__" not in n} <= names


# -- a user's own train.py, serve.py and configs/ ------------------------------------------------
@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A working directory whose files would shadow ours if anything imported them by name."""
    root = tmp_path_factory.mktemp("user")
    for name in ("train.py", "serve.py"):
        (root / name).write_text(f"raise ImportError('the user\\'s {name} was imported')\n")
    (root / "configs").mkdir()
    (root / "configs" / "__init__.py").write_text(
        'raise ImportError("the user\'s configs package was imported")\n'
    )
    return root


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )


def _console_script() -> str:
    script = Path(sys.executable).parent / "dspark-jax"
    return str(script) if script.exists() else shutil.which("dspark-jax")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_helps_from_a_users_folder(user_dir, command):
    done = _run([_console_script(), command, "--help"], user_dir)
    assert done.returncode == 0, done.stderr
    assert f"usage: dspark-jax {command}" in done.stdout


def test_generate_runs_from_a_users_folder(user_dir):
    done = _run([_console_script(), "generate", "--max-new-tokens", "8"], user_dir)
    assert done.returncode == 0, done.stderr
    assert "tau" in done.stderr and "generated" in done.stderr


def test_the_installed_wheel_runs_as_a_module_from_a_users_folder(wheel, user_dir, tmp_path):
    """`python -m` puts the working directory first on sys.path, where the user's files are."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    check = (
        "import sys, dspark_jax, dspark_jax.configs as c\n"
        "from dspark_jax.cli.train import train_config_names\n"
        f"assert dspark_jax.__file__.startswith({str(site)!r}), dspark_jax.__file__\n"
        "assert c.get('tiny-vanilla-dspark').block_size == 7\n"
        "assert 'tiny-dspark' in train_config_names()\n"
        f"assert not {set(TOP_LEVEL_FOLDERS)!r} & set(sys.modules)\n"
    )
    done = _run([sys.executable, "-c", check], user_dir, PYTHONPATH=str(site))
    assert done.returncode == 0, done.stderr
    for argv in (["train", "--help"], ["generate", "--max-new-tokens", "8"]):
        done = _run([sys.executable, "-m", "dspark_jax.cli", *argv], user_dir, PYTHONPATH=str(site))
        assert done.returncode == 0, done.stderr
