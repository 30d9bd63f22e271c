"""The job file's one error type: every problem names the file, the key path and the value."""
from __future__ import annotations

from typing import Any


class JobSpecError(ValueError):
    """An invalid job file or override. ``problems`` holds ``(key_path, message)``."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        lines = []
        for key, msg in self.problems:
            lines.append(f"{source}: {key}: {msg}" if key else f"{source}: {msg}")
        super().__init__("\n".join(lines))


class ResumeMismatchError(JobSpecError):
    """The output directory was written by a job with a different configuration."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
