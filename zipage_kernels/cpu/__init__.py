"""Native CPU kernels, compiled from C on first use (docs/design-notes.md, "Native CPU products").
This module needs no torch: the model listing asks it what a file would run as."""

from __future__ import annotations

import os
import shutil

# GGUF types whose groups the native products take as stored: 32 codes with a float16 scale (and a
# float16 offset for 4 bits). Q4_K's scales are products of two numbers, not float16 values.
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def c_compiler() -> str | None:
    """The C compiler the native products are built with ($CC, else cc), as a path; None if absent."""
    return shutil.which(os.environ.get("CC") or "cc")
