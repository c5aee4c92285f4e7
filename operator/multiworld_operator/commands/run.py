"""`multiworld run FILE.yaml`: its arguments -> a LocalRunner, run until done or signalled,
then the summary (and its JSON with --json)."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from pydantic import ValidationError

from multiworld_operator.local.faults import parse_suspend, planned_kills
from multiworld_operator.local.processes import TemplateError
from multiworld_operator.local.runner import LocalRunner
from multiworld_operator.local.summary import RunSummary
from multiworld_operator.local.view import LiveView
from multiworld_operator.spec import MultiWorld, SpecError, load_manifest, parse_manifest


def with_spares(multiworld: MultiWorld, choices: list[str]) -> MultiWorld:
    """The MultiWorld with `--spares` applied: `N` for every member, `MEMBER=N` for one (later
    choices win)."""
    data = multiworld.model_dump(by_alias=True, exclude_none=True)
    members = {m["name"]: m for m in data["spec"]["members"]}
    for choice in choices:
        member, _, count = choice.rpartition("=")
        if not count.isdigit():
            raise ValueError(f"--spares {choice}: expected N or MEMBER=N with N a whole number >= 0")
        if member and member not in members:
            raise ValueError(f"--spares {choice}: no member named {member!r} in the manifest")
        for name in [member] if member else list(members):
            members[name]["spares"] = int(count)
    try:
        return parse_manifest(data)
    except SpecError as error:
        raise ValueError("--spares: " + "; ".join(error.problems)) from None


def _load(args: argparse.Namespace) -> MultiWorld:
    """The manifest file, with `--spares` applied."""
    mw = load_manifest(args.file)
    return with_spares(mw, args.spares) if args.spares else mw


def _fail(message: str) -> int:
    sys.stderr.write(f"multiworld run: {message}\n")
    return 2


def run_from_args(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        return _fail(f"FILE: {args.file} does not exist")
    if args.workdir is not None and not args.workdir.is_dir():
        return _fail(f"--workdir {args.workdir}: no such directory")
    try:
        mw = _load(args)
        kills = planned_kills(args.kill, args.after)
        suspend = parse_suspend(args.suspend) if args.suspend else None
        if args.until_recovered and args.chaos:
            raise ValueError("--until-recovered: --chaos never ends, so nothing would end the run")
        if args.until_recovered and not (kills or suspend):
            raise ValueError("--until-recovered: there is nothing to recover from without --kill or --suspend")
        for kill in kills:
            pods = mw.pods_of(kill.member) if kill.member in {m.name for m in mw.spec.members} else None
            if pods is None:
                raise ValueError(f"--kill {kill.member}: no member named {kill.member!r} in the manifest")
            if kill.ordinal is not None and kill.ordinal >= len(pods):
                raise ValueError(f"--kill {kill.member}:{kill.ordinal}: member {kill.member!r} has {len(pods)} pod(s)")
        view = LiveView(f"multiworld run {mw.name}", live=False if args.no_view else None)
        runner = LocalRunner(
            mw,
            manifest_dir=args.file.resolve().parent,
            kills=kills,
            suspend=suspend,
            reload=lambda: _load(args),
            watch=args.file,
            chaos_per_minute=args.chaos,
            duration=args.duration,
            until_recovered=args.until_recovered,
            seed=args.seed,
            log_dir=args.log_dir,
            workdir=args.workdir,
            view=view,
        )
    except SpecError as exc:
        return _fail(f"{args.file} is not a valid MultiWorld:\n" + "\n".join(f"  {p}" for p in exc.problems))
    except (ValueError, TemplateError, ValidationError) as exc:
        return _fail(str(exc))
    summary = asyncio.run(_run_until_signal(runner))
    sys.stderr.write(summary.render())
    if args.json:
        sys.stdout.write(json.dumps(summary.model_dump(mode="json"), separators=(",", ":")) + "\n")
    return 0 if summary.ok else 1


async def _run_until_signal(runner: LocalRunner) -> RunSummary:
    """Ctrl-C, SIGTERM or a closed terminal (SIGHUP) ends the run cleanly: members stopped,
    summary printed. Whatever else ends the runner, its tether stops the members (tether.py)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, runner.request_stop)
    return await runner.run()
