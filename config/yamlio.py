"""Reading YAML and turning pydantic's errors into a ConfigError that names file, field and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from config.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class SpecProblems(ValueError):
    """Raised inside a validator to report several defects, each with its own field path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p}: {r}" for p, r in problems))


def read_yaml(path: Path | str) -> Any:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(str(p), [("", f"cannot read file: {e.strerror or e}")]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        reason = getattr(e, "problem", None) or str(e)
        raise ConfigError(str(p), [("", f"not valid YAML: {where}{reason}")]) from None


def _loc(parts: tuple[int | str, ...], prefix: str = "") -> str:
    out = prefix
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def problems_of(err: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for e in err.errors():
        loc = _loc(tuple(e["loc"]), prefix)
        inner = (e.get("ctx") or {}).get("error")
        if isinstance(inner, SpecProblems):
            for path, reason in inner.problems:
                joined = f"{loc}.{path}" if loc and path else (loc or path)
                problems.append((joined, reason))
            continue
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (not a field of this section)"
        elif e["type"] in ("missing",):
            msg = "required field is missing"
        else:
            got = e.get("input")
            if not isinstance(got, dict | list) and e["type"] != "value_error":
                msg = f"{msg} (got {got!r})"
        problems.append((loc, msg))
    return problems


def validate(cls: type[M], data: Any, *, source: str | None = None, prefix: str = "",
             context: dict[str, Any] | None = None) -> M:
    """Validate ``data`` as ``cls``; on failure raise ConfigError listing every bad field."""
    try:
        return cls.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(source, problems_of(err, prefix)) from None
