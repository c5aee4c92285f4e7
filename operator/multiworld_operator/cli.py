"""`multiworld run | status | operator | crd`: one entry point, each command imported only when used
(the local runner needs no kopf, the operator needs no torch)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TypeVar

from multiworld_operator import log_context

N = TypeVar("N", int, float)


def _installed_version() -> str:
    """The installed package's version; the code also runs from a source tree on PYTHONPATH,
    which has none."""
    try:
        return version("multiworld")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def _number(text: str, kind: type[N], what: str) -> N:
    """`text` as a number, or argparse's error naming what was expected (argparse would name
    the function that parsed it)."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _positive(text: str) -> float:
    value = _number(text, float, "a number of seconds")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _lease_seconds(text: str) -> int:
    value = _number(text, int, "a whole number of seconds")
    if value < 3:
        raise argparse.ArgumentTypeError(f"must be >= 3 (seconds), got {text}")
    return value


def _port(text: str) -> int:
    value = _number(text, int, "a port number")
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port between 1 and 65535, got {text}")
    return value


# What `multiworld --help` says first (the module's docstring is for maintainers).
DESCRIPTION = (
    "Fault-isolated torch.distributed worlds, declared in a MultiWorld manifest: `multiworld run FILE.yaml` runs "
    "one on this machine, no cluster needed; `status`, `operator` and `crd` are for Kubernetes."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multiworld", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logs (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a MultiWorld manifest as local processes, no cluster needed")
    run.add_argument("file", type=Path, help="YAML file holding a MultiWorld manifest")
    run.add_argument("--duration", type=_positive, metavar="SECONDS", help="stop everything after SECONDS")
    run.add_argument(
        "--until-recovered",
        action="store_true",
        help="end the run once every --kill and --suspend has happened and every world runs again "
        "(--duration still bounds it)",
    )
    run.add_argument(
        "--kill",
        action="append",
        default=[],
        metavar="MEMBER[:ORDINAL]",
        help="SIGKILL a member's pod (repeatable, paired in order with --after)",
    )
    run.add_argument(
        "--after",
        action="append",
        default=[],
        type=_non_negative,
        metavar="SECONDS",
        help="when the matching --kill happens: seconds after every world first ran",
    )
    run.add_argument(
        "--chaos",
        type=_non_negative,
        default=0.0,
        metavar="KILLS_PER_MINUTE",
        help="kill random members at this average rate, once every world ran",
    )
    run.add_argument(
        "--suspend",
        metavar="AFTER:FOR",
        help="set spec.suspend for FOR seconds, AFTER seconds after every world first ran: every member "
        "stops, and each world comes back at its next epoch",
    )
    run.add_argument("--seed", type=int, help="random seed for --chaos and random ordinals")
    run.add_argument("--log-dir", type=Path, help="where each member's output goes (default: a temp dir)")
    run.add_argument("--workdir", type=Path, help="working directory of the members (default: found from the command)")
    run.add_argument("--json", action="store_true", help="end with the summary as one JSON line")
    run.add_argument("--no-view", action="store_true", help="no live view; log state changes instead")
    run.add_argument(
        "--spares",
        action="append",
        default=[],
        metavar="[MEMBER=]N",
        help="warm spares of every member (N) or of one (MEMBER=N, repeatable) for this run, overriding "
        "spec.members[].spares: processes of the member's command waiting in init_from_env() to "
        "replace a dead pod at once (0: none)",
    )

    status = sub.add_parser(
        "status", help="show a MultiWorld on a cluster (or every MultiWorld of a namespace), from the kubeconfig"
    )
    status.add_argument("name", nargs="?", help="the MultiWorld (default: list the namespace's MultiWorlds)")
    status.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig context's)")
    status.add_argument("-w", "--watch", action="store_true", help="show it again on every change")
    status.add_argument("--kubeconfig", help="the kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")

    op = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    op.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable)")
    op.add_argument("--liveness", metavar="URL", help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    op.add_argument(
        "--metrics-port", type=_port, metavar="PORT", help="serve Prometheus metrics at https://0.0.0.0:PORT/metrics"
    )
    op.add_argument(
        "--metrics-secure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the metrics over HTTPS (the webhook's certificate, else a self-signed one) to a bearer token "
        "the API server says may get /metrics (a TokenReview and a SubjectAccessReview, as controller-runtime does); "
        "--no-metrics-secure: plain HTTP to anyone who can connect (default: secure)",
    )
    op.add_argument(
        "--webhook-port", type=int, metavar="PORT", help="serve the validating admission webhook on PORT (HTTPS)"
    )
    op.add_argument(
        "--webhook-host",
        metavar="NAME",
        help="with --webhook-port: the name the API server calls the webhook by (its certificate's), "
        "e.g. SERVICE.NAMESPACE.svc",
    )
    op.add_argument(
        "--webhook-configuration",
        metavar="NAME",
        help="with --webhook-port: the ValidatingWebhookConfiguration whose caBundle the operator keeps",
    )
    op.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="act only while holding a Lease, so that replicas stand by (default: off, this operator acts alone)",
    )
    op.add_argument("--lease-namespace", help="the Lease's namespace (default: $POD_NAMESPACE)")
    op.add_argument("--lease-name", default="multiworld-operator", help="the Lease's name (default: %(default)s)")
    op.add_argument(
        "--lease-duration",
        type=_lease_seconds,
        default=15,
        metavar="SECONDS",
        help="a standby takes over a Lease not renewed for this long (default: %(default)s)",
    )

    sub.add_parser("crd", help="print the MultiWorld CustomResourceDefinition generated from the spec models")
    return parser


def _configure_logging(verbose: int) -> None:
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    if os.environ.get("MULTIWORLD_LOG_LEVEL"):
        level = logging.getLevelName(os.environ["MULTIWORLD_LOG_LEVEL"].upper())
    log_context.configure(level)


def _no_operator_extra(command: str, error: ModuleNotFoundError) -> int:
    """`status` and `operator` in an install without the operator extra (`pip install '.[worker]'`
    has no Kubernetes client): said in one line, exit status 1."""
    print(
        f"multiworld {command}: this install has no {error.name} (the Kubernetes client and kopf come with the "
        "operator extra): pip install -c constraints.txt '.[operator]', in the repository",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    if args.command == "crd":
        from multiworld_operator.crd import crd_yaml

        sys.stdout.write(crd_yaml())
        return 0
    if args.command == "run":
        from multiworld_operator.commands.run import run_from_args

        return run_from_args(args)
    if args.command == "status":
        try:
            from multiworld_operator.commands.status import show
        except ModuleNotFoundError as error:
            return _no_operator_extra(args.command, error)
        return show(args.name, args.namespace, args.watch, args.kubeconfig)
    try:
        from multiworld_operator.kube.admission.webhook import Webhook
        from multiworld_operator.kube.leadership import LeaseConfig
        from multiworld_operator.kube.liveness import Liveness
        from multiworld_operator.kube.main import run_operator
    except ModuleNotFoundError as error:
        return _no_operator_extra(args.command, error)

    webhook = None
    if args.webhook_port is not None:
        if not args.webhook_host or not args.webhook_configuration:
            parser.error("--webhook-port needs --webhook-host and --webhook-configuration")
        webhook = Webhook(args.webhook_port, args.webhook_host, args.webhook_configuration)
    liveness = None
    if args.liveness is not None:
        try:
            liveness = Liveness(args.liveness)
        except ValueError as error:
            parser.error(str(error))
    lease = None
    if args.leader_election:
        try:
            lease = LeaseConfig.from_env(args.lease_namespace, args.lease_name, args.lease_duration)
        except ValueError as error:
            parser.error(str(error))
    return run_operator(
        namespaces=args.namespace,
        liveness=liveness,
        webhook=webhook,
        lease=lease,
        metrics_port=args.metrics_port,
        metrics_secure=args.metrics_secure,
    )


if __name__ == "__main__":
    sys.exit(main())
