"""A local run follows its manifest file (the local `kubectl apply`): an edit of templates
(rolled out per spec.updateStrategy), failure policies, spares or suspend applies to the
running MultiWorld. Members, replicas and worlds stay as the run began; an edit that changes
them, or is invalid, is refused and said."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from multiworld_operator.local.launcher import Commands, check_commands, member_commands
from multiworld_operator.local.processes import TemplateError
from multiworld_operator.local.view import LiveView
from multiworld_operator.spec import MultiWorld, SpecError


class ManifestFollower:
    """`reload` reads the manifest again (None: nothing to follow); `watch` is its file, looked
    at for a new modification time."""

    def __init__(self, reload: Callable[[], MultiWorld] | None, watch: Path | None) -> None:
        self.reload, self.watch = reload, watch
        self.watched = _mtime(watch)

    def edited(self, current: MultiWorld, workdir: Path, view: LiveView) -> tuple[MultiWorld, Commands] | None:
        """The manifest as edited since last looked at, with its members' commands (run from
        `workdir`); None when it was not edited, or the edit is refused (said in `view`)."""
        mtime = _mtime(self.watch)
        if self.reload is None or mtime == self.watched:
            return None
        self.watched = mtime
        try:
            edited = self.reload()
            changes = layout_changes(current, edited)
            if changes:
                kept = "members, replicas and worlds stay as the run began: start it again for that"
                raise ValueError(f"{'; '.join(changes)} ({kept})")
            commands = member_commands(edited)
            check_commands(edited, commands, workdir)
        except (SpecError, ValueError, TemplateError, ValidationError, OSError) as exc:
            view.event(f"manifest edit refused: {exc}")
            return None
        view.event("manifest edited: applying it")
        return edited, commands


def _mtime(path: Path | None) -> int | None:
    try:
        return None if path is None else path.stat().st_mtime_ns
    except OSError:
        return None


def layout_changes(current: MultiWorld, edited: MultiWorld) -> list[str]:
    """What a running local MultiWorld keeps (its name, members' replicas, worlds and
    backends) that `edited` changes, one line per field: `FIELD: OLD -> NEW`."""
    before, after = _layout(current), _layout(edited)
    fields = list(before) + [f for f in after if f not in before]
    return [
        f"{f}: {before.get(f, '(none)')} -> {after.get(f, '(none)')}" for f in fields if before.get(f) != after.get(f)
    ]


def _layout(multiworld: MultiWorld) -> dict[str, object]:
    """The kept fields by their paths: per member and world where the names stay, else the
    list of names."""
    spec = multiworld.spec
    fields: dict[str, object] = {"metadata.name": multiworld.name, "spec.backend": spec.backend}
    fields["spec.members[].name"] = [m.name for m in spec.members]
    for i, member in enumerate(spec.members):
        fields[f"spec.members[{i}].replicas"] = member.replicas
    fields["spec.worlds[].name"] = [w.name for w in spec.worlds]
    for i, world in enumerate(spec.worlds):
        fields[f"spec.worlds[{i}].ranks"] = world.ranks
        fields[f"spec.worlds[{i}].backend"] = world.backend
    return fields
