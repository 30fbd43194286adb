"""lingc/knobs.py: the LINGC_* environment knobs (integers, on / off switches), and the error a bad one gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lingc.knobs import env_flag, env_int


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


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), (" ON ", True), ("Yes", True),
                                      ("0", False), ("false", False), ("off", False), ("NO", False)])
def test_env_flag_spellings(raw: str, want: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LINGC_TEST_FLAG", raw)
    assert env_flag("LINGC_TEST_FLAG", not want) is want


def test_env_flag_default_and_typos(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or empty: the default. Anything else is an error naming the variable: before, every value but "1" was
    silently "off" (and for LINGC_KDA_FUSED_DECODE every value but "0" silently "on")."""
    monkeypatch.delenv("LINGC_TEST_FLAG", raising=False)
    assert env_flag("LINGC_TEST_FLAG", True) is True and env_flag("LINGC_TEST_FLAG", False) is False
    monkeypatch.setenv("LINGC_TEST_FLAG", "")
    assert env_flag("LINGC_TEST_FLAG", True) is True
    monkeypatch.setenv("LINGC_TEST_FLAG", "2")
    with pytest.raises(ValueError, match=r"LINGC_TEST_FLAG='2': want 1 or 0 .*default 1\)"):
        env_flag("LINGC_TEST_FLAG", True)


@pytest.mark.parametrize("module,name,value,message", [
    ("lingc.kernels.mla", "LINGC_MLA_COMBINE_ONE_STEP", "on", "want an integer (default 1)"),
    ("lingc.passes.fuse_kda", "LINGC_KDA_FUSED_DECODE", "flase", "want 1 or 0"),
    ("lingc.kernels.moe", "LINGC_MOE_SHARED_EARLY", "always", "want auto, 1 or 0"),
], ids=["integer", "switch", "shared-early"])
def test_a_module_with_a_bad_knob_fails_at_import_naming_it(module: str, name: str, value: str, message: str) -> None:
    """Kernels and passes read their knobs at import: a malformed one stops the import with the variable's name,
    where a bare int() said only "invalid literal" and a mistyped switch passed for off (or on)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                          env=dict(os.environ, **{name: value}), timeout=300)
    assert proc.returncode != 0
    assert f"{name}={value!r}: {message}" in proc.stderr
