"""The notebooks run top to bottom, so they cannot rot."""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.fixture
def kernel_of_this_interpreter(tmp_path, monkeypatch):
    """A ``python3`` kernelspec that runs the interpreter running pytest (the venv's, where forge is
    installed), found before any user-wide ``python3`` spec that may point at another Python."""
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "forge", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "python3"


def test_losses_notebook_runs_and_draws_its_figure(kernel_of_this_interpreter):
    notebook = nbformat.read(NOTEBOOKS / "losses.ipynb", as_version=4)
    # Appended to the in-memory copy only: proves which interpreter ran the cells.
    notebook.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = NotebookClient(
        notebook,
        kernel_name=kernel_of_this_interpreter,
        timeout=300,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if a cell fails

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for output in outputs), "the notebook drew no figure"
    assert notebook.cells[-1].outputs[0].text.strip() == sys.executable
