"""The layer table of docs/architecture.md as data: what each layer must not import.

`tests/support/import_graph.py` (run by `make check`) reports every import that breaks a rule
here. Each layer's `name` and its rules' labels are the table's first and last columns, word for
word: tests/packaging/test_import_graph.py compares `must_not_cell()` with the doc, so a change to one
is a change to the other. A module name here stands for the module and everything under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support.import_graph import Site

OP = "multiworld_operator"
TORCH_AT_LOAD = ("world.core", "world.backends", "world.ops", "world.stores", "world.rendezvous")
LIGHT = (
    "contract",
    "detect.config",
    "detect.verdicts",
    "detect.silence",
    "errors",
    "world.reduce_op",
    "shutdown",
    "world.work",
    "metrics",
    "metrics_server",
    "log_context",
    "per_source",
)
# The worker modules the operator imports: the messages, and the rate-limited warnings of the
# surfaces both serve.
SHARED = ("contract", "per_source")


def within(name: str, pattern: str) -> bool:
    return name == pattern or name.startswith(pattern + ".")


def _any_within(name: str, patterns: tuple[str, ...]) -> bool:
    return any(within(name, p) for p in patterns)


@dataclass(frozen=True)
class Rule:
    """One thing a layer must not import: `targets` but `allowed`, from any of the layer's
    modules but those `allowed_in`; with `at_load`, only an import that runs when the module
    loads counts (one inside a function or under TYPE_CHECKING does not)."""

    label: str
    targets: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    allowed_in: tuple[str, ...] = ()
    at_load: bool = False

    def breaks(self, importer: str, site: Site) -> bool:
        return (
            _any_within(site.target, self.targets)
            and not _any_within(site.target, self.allowed)
            and not _any_within(importer, self.allowed_in)
            and (site.at_load or not self.at_load)
        )


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]
    must_not: tuple[Rule, ...]
    but: tuple[str, ...] = ()
    note: str = ""  # what the import check cannot see

    def holds(self, module: str) -> bool:
        return _any_within(module, self.modules) and not _any_within(module, self.but)

    def breaks(self, importer: str, site: Site) -> list[Rule]:
        return [rule for rule in self.must_not if rule.breaks(importer, site)]

    def must_not_cell(self) -> str:
        cell = ", ".join(rule.label for rule in self.must_not)
        return f"{cell}; {self.note}" if self.note else cell


def _op(*names: str) -> tuple[str, ...]:
    return tuple(f"{OP}.{n}" for n in names)


def _mw(*names: str) -> tuple[str, ...]:
    return tuple(f"multiworld.{n}" for n in names)


KUBE, LOCAL = _op("kube"), _op("local")
TORCH = Rule("torch", ("torch",))
KUBERNETES = Rule("kubernetes", ("kubernetes",))
KOPF = Rule("kopf", ("kopf",))
OTHER_WORKER = Rule("any other `multiworld` module", ("multiworld",), allowed=_mw("contract"))
OTHER_THAN_SHARED = "any `multiworld` module but `multiworld.contract` and `multiworld.per_source`"
KUBE_LOCAL = (Rule("kube", KUBE), Rule("local", LOCAL))

LAYERS: tuple[Layer, ...] = (
    Layer(
        "the operator: `multiworld_operator`",
        (OP,),
        (
            Rule("torch (its image has none)", ("torch",)),
            Rule(OTHER_THAN_SHARED, ("multiworld",), allowed=_mw(*SHARED)),
            Rule(
                "kubernetes outside `kube/` and `commands/status`",
                ("kubernetes",),
                allowed_in=(*KUBE, *_op("commands.status")),
            ),
            Rule("kopf outside `kube/`", ("kopf",), allowed_in=KUBE),
        ),
    ),
    Layer(
        "`spec/`",
        _op("spec"),
        (
            Rule("any other operator module (planner, kube, local, ...)", (OP,), allowed=_op("spec")),
            KUBERNETES,
            KOPF,
            TORCH,
        ),
    ),
    Layer("`crd.py`", _op("crd"), (*KUBE_LOCAL, KUBERNETES, TORCH)),
    Layer(
        "`planner/`",
        _op("planner"),
        (
            Rule(
                "any operator module outside `planner/` and `spec/` (kube, local, ...)",
                (OP,),
                allowed=_op("planner", "spec"),
            ),
            OTHER_WORKER,
            KUBERNETES,
            KOPF,
            TORCH,
        ),
        note="no I/O, no `datetime.now` (not seen by the import check)",
    ),
    Layer("`channel_server.py`", _op("channel_server"), (*KUBE_LOCAL, KUBERNETES, KOPF, TORCH)),
    Layer("`world_secrets.py`", _op("world_secrets"), (*KUBE_LOCAL, KUBERNETES, KOPF, TORCH)),
    Layer(
        "`kube/`",
        KUBE,
        (
            Rule("local", LOCAL),
            TORCH,
            Rule(f"the worker runtime ({OTHER_THAN_SHARED})", ("multiworld",), allowed=_mw(*SHARED)),
            Rule(
                "kopf outside `handlers`, `main` and `admission/`",
                ("kopf",),
                allowed_in=_op("kube.handlers", "kube.main", "kube.admission"),
            ),
            Rule(
                "cryptography outside `admission/certificate`",
                ("cryptography",),
                allowed_in=_op("kube.admission.certificate"),
            ),
            Rule("aiohttp outside `admission/serving`", ("aiohttp",), allowed_in=_op("kube.admission.serving")),
        ),
    ),
    Layer(
        "`local/`",
        LOCAL,
        (Rule("kube", KUBE), KUBERNETES, KOPF, Rule("torch (`gpus.py` asks a child interpreter)", ("torch",))),
    ),
    Layer(
        "`cli.py`",
        _op("cli"),
        (
            Rule(
                "kube, local, `commands` and `crd` at module top",
                (*KUBE, *LOCAL, *_op("commands", "crd")),
                at_load=True,
            ),
        ),
    ),
    Layer("`commands/run.py`", _op("commands.run"), (Rule("kube", KUBE), KUBERNETES, KOPF)),
    Layer("`commands/status.py`", _op("commands.status"), (Rule("local", LOCAL), KOPF)),
    Layer(
        ", ".join(f"`multiworld.{n}`" if n == "contract" else f"`{n}`" for n in LIGHT),
        _mw(*LIGHT),
        (
            TORCH,
            KUBERNETES,
            Rule("`multiworld_operator`", (OP,)),
            Rule("the rest of `multiworld`", ("multiworld",), allowed=_mw(*LIGHT)),
        ),
    ),
    Layer(
        "worker runtime",
        ("multiworld",),
        (
            Rule("kubernetes (never: a worker needs no API access)", ("kubernetes",)),
            KOPF,
            Rule("`multiworld_operator`", (OP,)),
        ),
    ),
    Layer(
        "worker runtime but " + ", ".join(f"`{n}`" for n in TORCH_AT_LOAD),
        ("multiworld",),
        (Rule("torch or any of those five at module top", ("torch", *_mw(*TORCH_AT_LOAD)), at_load=True),),
        but=_mw(*TORCH_AT_LOAD),
    ),
)
