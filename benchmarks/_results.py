"""Shared by the benchmark scripts: rewrite one marked section of RESULTS.md, leaving the others alone."""
from __future__ import annotations

import os
from pathlib import Path


def replace_marked_section(path: str, start: str, end: str, section: str) -> None:
    """Put `section` (which begins with `start` and ends with `end`) where the old marked one was, or
    append it when the file has none yet."""
    text = Path(path).read_text() if os.path.exists(path) else "# Benchmark results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as out:
        out.write(text)
