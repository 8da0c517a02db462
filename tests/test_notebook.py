"""Every notebook under notebooks/ runs top to bottom in a real Jupyter kernel (nbclient).

The install cell runs too: the kernel starts in notebooks/, so the cell finds this checkout by
walking up to its pyproject.toml and, since the test environment already imports dspark_jax from
the checkout, says so instead of reinstalling. The only cells left out are those tagged as needing
the network or a GPU; they are what a CPU runner cannot do, and the tags are what a reader sees.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
# Form fields set for the kernel run, as papermill would inject parameters: the training notebook
# trains two drafters for a test-sized number of CPU steps (its default, 300, takes ~6 minutes
# here), still enough for held-out loss to fall and tau to rise. Even so it is the longest test
# of the default run (two minutes on the CI machine), so it runs with the slow set, beside the
# default steps; the library calls it makes are held by test_python_api.py's training example
# and tests/test_train_*.py in the default run.
KERNEL_PARAMETERS = {"train_drafter": {"CPU_STEPS = 300  # @param": "CPU_STEPS = 40  # @param"}}
SLOW_KERNEL_RUNS = {"train_drafter"}
KERNEL_RUNS = [
    *(
        pytest.param(
            p,
            KERNEL_PARAMETERS.get(p.stem, {}),
            id=p.stem,
            marks=[pytest.mark.slow] if p.stem in SLOW_KERNEL_RUNS else [],
        )
        for p in NOTEBOOKS
    ),
    pytest.param(
        NOTEBOOK_DIR / "train_drafter.ipynb",
        {},
        marks=pytest.mark.slow,
        id="train_drafter-default-steps",
    ),
]
# Published safetensors total of Qwen3-4B (also pinned by tests/test_param_counts.py).
QWEN3_4B_PARAMS = 4_022_468_096
SKIP_TAGS = {"needs-network", "needs-gpu"}
# Hub ids and the converter reach the network: a cell using them must carry a skip tag.
NETWORK_MARKERS = ("deepseek-ai/", "Qwen/", "dspark-jax convert")
CHECKOUT_LINE = "already installed from this checkout"


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _tags(cell) -> set[str]:
    return set(cell.get("metadata", {}).get("tags", []))


def _install_cell(nb) -> nbformat.NotebookNode:
    return next(c for c in nb.cells if c.cell_type == "code")


def _execute(nb, cwd: Path, timeout: int = 600) -> nbformat.NotebookNode:
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    )
    return client.execute()


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


def test_there_are_notebooks():
    names = {"quickstart", "train_drafter", "released_checkpoint"}
    assert {NOTEBOOK_DIR / f"{name}.ipynb" for name in names} <= set(NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_valid_cleared_and_honest(path):
    nb = _read(path)
    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) >= (4, 5)
    # A committed notebook carries no outputs: the file shows source, and a diff shows edits.
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    # Colab must not be asked for a GPU: every cell that needs one is guarded and tagged.
    assert "accelerator" not in nb.metadata
    for cell in nb.cells:
        if cell.cell_type == "code" and any(m in cell.source for m in NETWORK_MARKERS):
            assert "needs-network" in _tags(cell), cell.source[:80]
        if "needs-gpu" in _tags(cell):
            assert 'jax.default_backend() != "gpu"' in cell.source
    # A rate printed from a cell that builds its engine must not include compiling: that cell
    # warms the engine up first (quickstart's section (e) printed tokens/s of the compile).
    for cell in nb.cells:
        if cell.cell_type == "code" and "tokens_per_s" in cell.source and "Engine(" in cell.source:
            built = cell.source.index("Engine(")
            assert "warm_up()" in cell.source[built:], cell.source[:80]
    # The install cell comes first, with empty Colab form fields and no placeholder URL.
    install = _install_cell(nb).source
    assert 'REPO_URL = ""  # @param {type:"string"}' in install
    assert 'WHEEL = ""  # @param {type:"string"}' in install
    assert "<org>" not in install and not _tags(_install_cell(nb))


def _shell_commands(source: str) -> list[list[str]]:
    """The commands of the ```bash blocks in a markdown cell's source, continuations joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", source, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(shlex.split(line))
    return commands


def test_released_checkpoint_shell_commands_fit_the_tables_it_writes():
    """The closing shell commands ran with an SPS table profiled for NUM_SLOTS slots, but
    generate ran one slot (one prompt) and serve its default 8: both were refused. Each command
    given a table must run the slot count the table was profiled for, as parsed by the CLI."""
    from dspark_jax.cli import _parser
    from dspark_jax.cli.args import engine_config

    nb = _read(NOTEBOOK_DIR / "released_checkpoint.ipynb")
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    sizes: dict = {}
    exec(next(line for line in code.splitlines() if line.startswith("NUM_SLOTS")), sizes)
    # What section (f) writes: a table profiled for NUM_SLOTS slots.
    assert "EngineConfig(num_slots=NUM_SLOTS)" in code and 'sps.save("sps.json")' in code
    tables = {"sps.json": sizes["NUM_SLOTS"]}
    (shell,) = [c for c in nb.cells if c.cell_type == "markdown" and "```bash" in c.source]
    commands = _shell_commands(shell.source)
    assert {"generate", "serve"} <= {argv[1] for argv in commands}
    for argv in commands:
        assert argv[0] == "dspark-jax", argv
        args = _parser(argv[1]).parse_args(argv[1:])
        if args.command == "profile":
            tables[args.out] = args.max_num_seqs
            continue
        if args.command == "serve":
            slots = args.max_num_seqs
        else:  # generate: one slot per prompt, at most --max-num-seqs
            assert args.command == "generate" and not args.prompts_file
            prompts = len(args.prompt) + len(args.token_ids) or 1
            slots = engine_config(args, [64] * prompts, 10**6).num_slots
        assert args.sps_table in tables, f"{args.sps_table} is written by no cell or command"
        assert slots == tables[args.sps_table], (argv, slots, tables)


def _set_parameters(nb, parameters: dict[str, str]) -> None:
    """Rewrites form-field lines; each must be found exactly once, so a renamed field fails."""
    for old, new in parameters.items():
        hits = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
        assert len(hits) == 1 and hits[0].source.count(old) == 1, old
        hits[0].source = hits[0].source.replace(old, new)


@pytest.mark.parametrize(("path", "parameters"), KERNEL_RUNS)
def test_notebook_runs_in_a_kernel(path, parameters, tmp_path, monkeypatch):
    nb = _read(path)
    _set_parameters(nb, parameters)
    skipped = [c for c in nb.cells if _tags(c) & SKIP_TAGS]
    nb.cells = [c for c in nb.cells if not _tags(c) & SKIP_TAGS]
    assert all(c.cell_type == "code" for c in skipped)
    checks = {
        # The quickstart's own results: lossless greedy decoding and real speculation.
        "quickstart": "print(json.dumps({'same': same, 'max_tau': max(r.tau for r in "
        "runs['speculative'][0]), 'tokens': sum(len(r.tokens) for r in runs['speculative'][0])}))",
        # Both drafters learned, decode losslessly, and the export reloads to the same drafter.
        "train_drafter": "print(json.dumps({'same': same, 'reload_same': reload_same, "
        "'same_weights': same_weights, 'reload_tau': reload_tau, "
        "'eval': {n: [r.eval_start, r.eval_end] for n, r in results.items()}, "
        "'rounds': {n: s.rounds for n, s in stats.items()}, 'temps': artifact.temperatures}))",
        # What runs without a GPU: the memory budget from the configs and the prompt set.
        "released_checkpoint": "print(json.dumps({'n_target': n_target, 'dtype': DTYPE, "
        "'need_gib': need / GiB, 'domains': {k: len(v) for k, v in DOMAINS.items()}}))",
    }
    check = checks.get(path.stem, "print('{}')")
    nb.cells.append(nbformat.v4.new_code_cell("import json\n" + check))

    # Scratch files the notebook makes (tempfile) land in this test's folder.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    try:
        ran = _execute(nb, NOTEBOOK_DIR)
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed in the kernel:\n{e}")

    assert CHECKOUT_LINE in _stdout(_install_cell(ran))
    assert all(c.execution_count is not None for c in ran.cells if c.cell_type == "code")
    assert any("image/png" in o.get("data", {}) for c in ran.cells for o in c.get("outputs", []))
    result = json.loads(_stdout(ran.cells[-1]))
    if path.stem == "quickstart":
        assert result["same"] is True
        assert result["tokens"] > 0 and result["max_tau"] > 1.0
    if path.stem == "train_drafter":
        assert result["same"] is True and result["reload_same"] is True
        assert result["same_weights"] is True and result["reload_tau"] > 1.0
        for name, (start, end) in result["eval"].items():
            assert end["loss"] < start["loss"] and end["tau"] > start["tau"], name
        assert min(result["rounds"].values()) > 100
        assert len(result["temps"]) == 7
        # loss curves, acceptance bars and the reliability diagram
        pngs = [
            o for c in ran.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
        ]
        assert len(pngs) >= 3
    if path.stem == "released_checkpoint":
        assert result["n_target"] == QWEN3_4B_PARAMS
        # no GPU here, so no bfloat16: the notebook must choose float16
        assert result["dtype"] == "float16"
        assert 9 < result["need_gib"] < 13
        assert set(result["domains"]) == {"math", "code", "chat"}


# A kernel in which dspark_jax cannot be imported, as on a fresh Colab runtime: a None entry in
# sys.modules makes importlib.util.find_spec answer None.
HIDE_PACKAGE = 'import sys\nsys.modules["dspark_jax"] = None'


def test_install_cell_outside_a_checkout_says_what_to_do(tmp_path):
    # Opened away from a checkout with both form fields empty and nothing installed (a fresh
    # Colab), the cell stops at once with the one line that says what to fill in, instead of
    # failing cells later.
    install = _install_cell(_read(NOTEBOOK_DIR / "quickstart.ipynb"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(HIDE_PACKAGE), install])
    with pytest.raises(CellExecutionError, match="set REPO_URL .* or WHEEL"):
        _execute(nb, tmp_path, timeout=120)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_install_cell_outside_a_checkout_keeps_an_installed_package(path, tmp_path):
    # Away from a checkout but with dspark_jax already importable (installed from a wheel, or the
    # cell run before on Colab), the cell keeps it rather than refusing to go on.
    nb = nbformat.v4.new_notebook(cells=[_install_cell(_read(path))])
    ran = _execute(nb, tmp_path, timeout=120)
    out = _stdout(ran.cells[0])
    assert "dspark_jax is already installed (" in out and "nothing to do" in out
    assert "pip install" not in out


@pytest.mark.parametrize(
    ("field", "gpu", "installs"),
    [
        ('REPO_URL = "https://example.org/dspark-jax.git"', True,
         "dspark-jax[gpu] @ git+https://example.org/dspark-jax.git"),
        ('REPO_URL = "https://example.org/dspark-jax.git"', False,
         "dspark-jax @ git+https://example.org/dspark-jax.git"),
        ('WHEEL = "dspark_jax-1-py3-none-any.whl"', True,
         "dspark-jax[gpu] @ file://{cwd}/dspark_jax-1-py3-none-any.whl"),
    ],
    ids=["git-gpu", "git-cpu", "wheel-gpu"],
)
def test_install_cell_brings_jax_cuda_on_a_gpu_runtime(field, gpu, installs, tmp_path, monkeypatch):
    """On a GPU runtime (nvidia-smi on the PATH) the install asks for the `gpu` extra: were pip
    to raise Colab's JAX to the package's floor without the CUDA plugin, JAX would run on the
    CPU and every GPU cell would say it needs a GPU runtime. pip itself is not run here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    (tmp_path / "dspark_jax-1-py3-none-any.whl").write_bytes(b"")
    install = _install_cell(_read(NOTEBOOK_DIR / "quickstart.ipynb"))
    record_pip = (
        "import subprocess\n"
        "subprocess.run = lambda argv, **kw: print('RAN', ' | '.join(map(str, argv)))"
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(record_pip), install])
    empty = field.split("=")[0] + '= ""'
    _set_parameters(nb, {empty: field})
    ran = _execute(nb, tmp_path, timeout=120)
    out = _stdout(ran.cells[1])
    pip = f"RAN {sys.executable} | -m | pip | install | -q | "
    assert pip + installs.format(cwd=tmp_path) in out, out


# Run in the fresh virtualenv by the test below: the driver is the only thing there besides the
# Jupyter packages, so everything the notebook imports comes from its own install cell.
FRESH_DRIVER = """
import sys
import nbformat
from nbclient import NotebookClient

path, cwd, out = sys.argv[1:]
nb = nbformat.read(path, as_version=4)
skip = {"needs-network", "needs-gpu"}
nb.cells = [c for c in nb.cells if not skip & set(c.metadata.get("tags", []))]
resources = {"metadata": {"path": cwd}}
NotebookClient(nb, timeout=1800, kernel_name="python3", resources=resources).execute()
nbformat.write(nb, out)
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_installs_itself_into_a_fresh_virtualenv(path, tmp_path):
    # What a newcomer does: a virtualenv with only Jupyter, the notebook opened from the checkout.
    # The install cell must pip-install the checkout and make it importable in the running kernel
    # (this reaches PyPI for the dependencies, hence slow and not in the default run).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    jupyter = ["nbclient", "nbformat", "ipykernel"]
    subprocess.run([python, "-m", "pip", "install", "-q", *jupyter], check=True)
    probe = subprocess.run([python, "-c", "import jax"], capture_output=True)
    assert probe.returncode != 0, "the fresh virtualenv must not have the dependencies yet"
    driver, out = tmp_path / "driver.py", tmp_path / "ran.ipynb"
    driver.write_text(FRESH_DRIVER, encoding="utf-8")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    subprocess.run([python, driver, path, NOTEBOOK_DIR, out], check=True, timeout=2400, env=env)
    ran = _read(out)
    assert f"pip install -e {NOTEBOOK_DIR.parent}" in _stdout(_install_cell(ran))
    assert all(c.execution_count is not None for c in ran.cells if c.cell_type == "code")
    if path.stem == "quickstart":
        assert any("greedy outputs identical: True" in _stdout(c) for c in ran.cells)
