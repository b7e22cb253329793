"""The environment switches of the kernels (``SEMIPACK_COMPILE``, ``SEMIPACK_NATIVE``,
``SEMIPACK_NATIVE_AVX512``, ``SEMIPACK_ONEDNN``), read one way."""

from __future__ import annotations

import os

#: Values that switch a kernel off, compared case-insensitively after stripping blanks.
OFF = frozenset({"0", "false", "no", "off"})


def switched_on(name: str) -> bool:
    """Whether the environment variable ``name`` leaves its kernel on: unset, or anything
    but 0 / false / no / off (``OFF``; any case, blanks around ignored)."""
    return os.environ.get(name, "1").strip().lower() not in OFF
