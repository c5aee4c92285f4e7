"""Loading a MultiWorld: `load_manifest(path_or_text)` (a YAML file, a Path or a str naming an
existing file, or YAML text) and `parse_manifest(data)` (an already-parsed mapping, e.g. the
body kopf hands over). Both raise `SpecError` listing every problem at once: the models' field
errors, then the cross-field checks' problems, each prefixed by its field path
(`spec.worlds[1].ranks[2]: member 'w3' is not declared`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from multiworld_operator.spec.cross_field import cross_field_problems, nesting_problems
from multiworld_operator.spec.limits import MAX_PROBLEM_LENGTH, MAX_PROBLEMS
from multiworld_operator.spec.models import CROSS_FIELD_ERROR, MultiWorld


class SpecError(ValueError):
    """An invalid MultiWorld; `problems` holds the problems found, each naming its field: at
    most MAX_PROBLEMS of MAX_PROBLEM_LENGTH characters, then a line saying how many more
    (`count`: all of them)."""

    def __init__(self, problems: list[str]) -> None:
        self.count = len(problems)
        self.problems = [_shortened(p, MAX_PROBLEM_LENGTH) for p in problems[:MAX_PROBLEMS]]
        if self.count > MAX_PROBLEMS:
            self.problems.append(f"and {self.count - MAX_PROBLEMS} more problem(s)")
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid MultiWorld ({self.count} problem(s)):\n{lines}")


def _shortened(text: str, length: int) -> str:
    return text if len(text) <= length else text[: length - 3] + "..."


def load_manifest(source: str | Path) -> MultiWorld:
    """Load a MultiWorld from a YAML file (a Path, or a str naming an existing file) or YAML text."""
    text, name = (source.read_text(), str(source)) if isinstance(source, Path) else _text_of(source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([_yaml_problem(exc, name)]) from exc
    return parse_manifest(data)


def _text_of(source: str) -> tuple[str, str]:
    """The YAML text and what to call it in errors: the file's name, or `manifest`."""
    # One line naming a file is a path; one line without YAML structure must be one too.
    if "\n" not in source:
        if Path(source).is_file():
            return Path(source).read_text(), source
        if ":" not in source:
            raise SpecError([f"manifest: no such file {source!r}"])
    return source, "manifest"


def _yaml_problem(error: yaml.YAMLError, name: str) -> str:
    """A YAML error as one line naming the file and where in it (yaml's own message names a
    stream, not the file)."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return f"{name}: not valid YAML: {error}"
    mark = error.problem_mark or error.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = "; ".join(part for part in (error.context, error.problem) if part)
    return f"{name}: not valid YAML{where}: {what}"


def parse_manifest(data: object) -> MultiWorld:
    """Validate a parsed manifest; raise SpecError listing every problem."""
    if not isinstance(data, Mapping):
        raise SpecError([f"manifest: expected a mapping (a MultiWorld object), got {type(data).__name__}"])
    problems = nesting_problems(data)
    if problems:
        raise SpecError(problems)
    problems = cross_field_problems(data)
    try:
        multiworld = MultiWorld.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_field_problems(exc) + problems) from None
    return multiworld


def _field_problems(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        if error["type"] == CROSS_FIELD_ERROR:
            continue
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"{field_path(error['loc'])}: {message}")
    return problems


def field_path(loc: tuple[str | int, ...]) -> str:
    """('spec', 'worlds', 1, 'ranks', 2) -> 'spec.worlds[1].ranks[2]'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "manifest"
