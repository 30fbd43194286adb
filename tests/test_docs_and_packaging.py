"""Keep docs/ and pyproject.toml true to the code: every op and pass documented, every package installed."""

from __future__ import annotations

import tomllib
from pathlib import Path

from lingc.ops import OPS
from lingc.passes import PASSES

ROOT = Path(__file__).resolve().parents[1]


def test_every_lingc_op_is_documented_in_ir_md():
    text = (ROOT / "docs" / "ir.md").read_text()
    missing = [name for name in OPS if f"`{name}`" not in text]
    assert not missing, f"docs/ir.md lacks ops {missing}"


def test_every_pass_is_documented_in_passes_md():
    text = (ROOT / "docs" / "passes.md").read_text()
    missing = [name for name in PASSES if f"`{name}`" not in text]
    assert not missing, f"docs/passes.md lacks passes {missing}"


def test_pyproject_installs_every_package_directory():
    """A non-editable install (the GPU machine's) must carry every subpackage, not only the top ones."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(tool["packages"]), tool["package-dir"]
    for pkg, src in dirs.items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src)
            name = ".".join([pkg, *rel.parts]) if rel.parts else pkg
            assert name in packages, f"{init.parent} is package {name}, missing from [tool.setuptools] packages"
