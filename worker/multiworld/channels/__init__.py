"""Channel selection by the scheme of MULTIWORLD_TABLE; channel modules load lazily."""

from __future__ import annotations

import importlib

from multiworld.channels.base import Channel, TableCallback
from multiworld.contract import ENV_TABLE

SCHEMES = {
    "local": "multiworld.channels.stream",
    "operator": "multiworld.channels.stream",
}


def open_channel(url: str, pod: str) -> Channel:
    """ "" -> none (static env), "local://HOST:PORT" -> the local runner,
    "operator://HOST:PORT" -> the operator."""
    if not url.strip():
        module = importlib.import_module("multiworld.channels.none")
    else:
        scheme, sep, _ = url.partition("://")
        if not sep:
            raise ValueError(f"{ENV_TABLE}={url!r} is not a channel URL ({_choices()})")
        if scheme not in SCHEMES:
            raise ValueError(f"{ENV_TABLE}={url!r} has an unknown scheme {scheme!r} ({_choices()})")
        try:
            module = importlib.import_module(SCHEMES[scheme])
        except ImportError as exc:
            raise ImportError(f"the {scheme}:// channel cannot be loaded: {exc}") from exc
    channel: Channel = module.from_url(url, pod)  # each channel module's from_url returns one
    return channel


def _choices() -> str:
    return "use '' for none, 'local://HOST:PORT' or 'operator://HOST:PORT'"


__all__ = ["SCHEMES", "Channel", "TableCallback", "open_channel"]
