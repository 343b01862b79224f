"""The one error type configuration loading raises."""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """A configuration file or object is invalid.

    ``problems`` holds one ``(field path, reason)`` pair per defect so callers and tests can inspect
    them; ``str()`` names the source file (when known), every field path and every reason.
    """

    def __init__(self, source: str | None, problems: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        where = f"{source}: " if source else ""
        lines = [f"{where}{path or '<top>'}: {reason}" for path, reason in self.problems]
        super().__init__("invalid configuration\n  " + "\n  ".join(lines))
