"""pyproject.toml read by setuptools as `pip install -e .` reads it (issue 47): no warning from the project's own
file (the license is an SPDX string, not the deprecated TOML table)."""

from __future__ import annotations

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_issue47_setuptools_reads_pyproject_without_a_warning() -> None:
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
