"""Environment knobs (LINGC_*), integers and on / off switches: read once at import, with an error naming the variable.

The kernels' tunables that an A/B may move without a code change are environment variables read when their module
is imported (the README's Tour lists them). `int(os.environ.get(...))` would fail on a bad value with Python's bare
"invalid literal for int()", not saying which of ~50 variables was wrong, and `== "1"` took any typo of a switch
("true", "yes", "2") for "off"; `env_int` and `env_flag` name the variable instead.
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


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """os.environ[name] as an on / off switch (1 / true / yes / on or 0 / false / no / off, any case), else
    `default`; a ValueError naming the variable and its value otherwise (a typo must not pass for "off")."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ValueError(f"environment variable {name}={raw!r}: want 1 or 0 (true / false, yes / no, on / off; "
                     f"default {int(default)})")
