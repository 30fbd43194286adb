"""Integer environment knobs (LINGC_*): read once at import, with an error that names the variable.

The kernels' tunables that an A/B may move without a code change are environment variables read when their module
is imported (the README's Tour lists them). `int(os.environ.get(...))` would fail on a bad value with Python's bare
"invalid literal for int()", not saying which of ~50 variables was wrong; `env_int` says it.
"""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """os.environ[name] as an int (base 10, surrounding spaces allowed), else `default`; a ValueError naming
    the variable and its value otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: want an integer (default {default})") from None
