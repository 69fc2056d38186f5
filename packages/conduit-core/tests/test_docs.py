"""Docstring examples run, and the README's core example works as written."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import conduit.edp
import conduit.schema
import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("module", [conduit.edp, conduit.schema], ids=lambda m: m.__name__)
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0, result


def test_readme_python_examples_run() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "the README has no Python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
