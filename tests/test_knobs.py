"""lingc/knobs.py: integer LINGC_* environment knobs, and the error a bad one gives at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lingc.knobs import env_int


def test_env_int_reads_the_variable_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LINGC_TEST_KNOB", raising=False)
    assert env_int("LINGC_TEST_KNOB", 7) == 7
    monkeypatch.setenv("LINGC_TEST_KNOB", "")
    assert env_int("LINGC_TEST_KNOB", 7) == 7
    monkeypatch.setenv("LINGC_TEST_KNOB", " 16 ")
    assert env_int("LINGC_TEST_KNOB", 7) == 16
    monkeypatch.setenv("LINGC_TEST_KNOB", "-1")
    assert env_int("LINGC_TEST_KNOB", 7) == -1


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LINGC_TEST_KNOB", "yes")
    with pytest.raises(ValueError, match=r"LINGC_TEST_KNOB='yes': want an integer \(default 7\)"):
        env_int("LINGC_TEST_KNOB", 7)


def test_a_kernel_module_with_a_bad_knob_fails_at_import_naming_it() -> None:
    """The kernels read their knobs at import: a malformed one stops the import with the variable's name, where a
    bare int() said only "invalid literal"."""
    env = dict(os.environ, LINGC_MLA_COMBINE_ONE_STEP="on")
    proc = subprocess.run([sys.executable, "-c", "import lingc.kernels.mla"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode != 0
    assert "LINGC_MLA_COMBINE_ONE_STEP='on': want an integer (default 1)" in proc.stderr
