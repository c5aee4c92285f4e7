"""The MultiWorld resource: what a manifest may say, and loading it.

Public API (stable; the local runner and the Kubernetes operator build on it), from here:

- `load_manifest(path_or_text) -> MultiWorld` and `parse_manifest(data) -> MultiWorld`, which
  raise `SpecError` naming every problem's field (`loading.py`);
- the models, `MultiWorld` and its parts, with the helpers the platforms ask (`models.py`);
- `pod_name`, `spare_name` (`names.py`) and `parse_duration` (`durations.py`).

The modules, one job each, each importing only those listed before it:

- `resource.py`: the resource's identity (group, version, kind, plural, short names);
- `limits.py`: the caps of every number and size in a spec, what each follows from, and the
  worlds' store ports a template may not declare;
- `names.py`: DNS labels, pod and spare names;
- `durations.py`: `30s`, `5m`, `1h30m`;
- `cross_field.py`: the checks that span fields (references, duplicates, sizes, name lengths),
  read tolerantly from the raw manifest so they are listed with the field errors;
- `models.py`: the pydantic models, each field checking its own bounds and names;
- `loading.py`: YAML and mappings in, a valid `MultiWorld` or one `SpecError` out.

Constants are imported from the module that says what they follow from
(`from multiworld_operator.spec.limits import MAX_PODS`).
"""

from __future__ import annotations

from multiworld_operator.spec.durations import parse_duration
from multiworld_operator.spec.loading import SpecError, load_manifest, parse_manifest
from multiworld_operator.spec.models import (
    Backoff,
    FailurePolicy,
    Member,
    Metadata,
    MultiWorld,
    MultiWorldSpec,
    UpdateStrategy,
    World,
)
from multiworld_operator.spec.names import pod_name, spare_name

__all__ = [
    "Backoff",
    "FailurePolicy",
    "Member",
    "Metadata",
    "MultiWorld",
    "MultiWorldSpec",
    "SpecError",
    "UpdateStrategy",
    "World",
    "load_manifest",
    "parse_duration",
    "parse_manifest",
    "pod_name",
    "spare_name",
]
