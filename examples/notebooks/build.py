"""Turn the percent-format sources in ``source/`` into notebooks and execute them.

    python examples/notebooks/build.py                  # every notebook
    python examples/notebooks/build.py radix_cache      # some of them

A source is a Python file whose cells start with ``# %%`` (code) or ``# %% [markdown]``
(markdown written as ``# `` comment lines); lines before the first marker are a header
that stays out of the notebook. The executed notebook, outputs and plots included, is
written next to this file, so that what is committed is what the code measured.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "source"
CELL_TIMEOUT_S = 600


def parse(text: str) -> list[nbformat.NotebookNode]:
    cells, kind, lines = [], None, []

    def flush():
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(
                ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in body.splitlines()
            )
            cells.append(nbformat.v4.new_markdown_cell(body))
        elif kind == "code" and body.strip():
            cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind = "markdown" if "[markdown]" in line else "code"
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def build(name: str) -> float:
    nb = nbformat.v4.new_notebook()
    nb.cells = parse((SOURCES / f"{name}.py").read_text())
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    start = time.perf_counter()
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}},
    )
    client.execute()
    elapsed = time.perf_counter() - start
    nbformat.write(nb, HERE / f"{name}.ipynb")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in SOURCES.glob("*.py"))
    for name in names:
        print(f"{name}: executed in {build(name):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
