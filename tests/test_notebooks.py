"""Every notebook in examples/notebooks runs top to bottom; a cell that raises fails.

The notebooks are slow next to unit tests (a minute or two each on a CPU), so they carry
the ``notebook`` marker: ``pytest -m "not notebook"`` leaves them out locally.
Rebuild a notebook's committed outputs with ``python examples/notebooks/build.py NAME``.
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"kernels_vs_spec", "paging_memory", "radix_cache"}


def _kernel_env():
    """The kernel's environment: the directory of the jaxattn under test first on its path,
    so that a notebook runs this code and not another copy an installed package (an editable
    install of another checkout) would resolve first from the notebook's directory."""
    import jaxattn

    root = pathlib.Path(jaxattn.__file__).resolve().parents[1]
    search = [str(root), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in search if p))


# A budget for a hung kernel or a runaway cell, not a performance bound: CI machines are
# shared and the notebooks take 1-2 minutes on an idle 2-core CPU.
TIMEOUT_S = 600


def test_notebooks_present():
    assert {p.stem for p in NOTEBOOKS} >= EXPECTED


def test_sources_match_notebooks():
    """Each committed notebook has its source and holds that source's cells."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build", NOTEBOOK_DIR / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for path in NOTEBOOKS:
        cells = build.parse((NOTEBOOK_DIR / "source" / f"{path.stem}.py").read_text())
        committed = nbformat.read(path, as_version=4).cells
        assert [(c.cell_type, c.source) for c in cells] == [
            (c.cell_type, c.source) for c in committed
        ], f"{path.name} is stale: rebuild it with examples/notebooks/build.py {path.stem}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    deadline = time.monotonic() + TIMEOUT_S
    with client.setup_kernel(env=_kernel_env()):
        for index, cell in enumerate(nb.cells):
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{path.name} ran past {TIMEOUT_S} s, stopped before cell {index}")
            client.timeout = int(left) + 1  # the whole notebook shares one budget
            client.execute_cell(cell, index)  # raises CellExecutionError on failure
