"""The names a MultiWorld gives and checks: DNS labels, member pods
`<mw>-<member>-<ordinal>` and warm spares `<mw>-<member>-spare-<serial in letters>`."""

from __future__ import annotations

import re

# A DNS label (RFC 1123): every name of the spec, and every pod name made from them.
MAX_LABEL = 63
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Service names (the headless Service is named after the MultiWorld) must start with a letter.
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# A warm spare's name must fit a label with room for this many letters of serial (26**4 spares
# over a MultiWorld's life).
SPARE_SERIAL_ROOM = 4


def is_label(value: str, pattern: re.Pattern[str] = DNS1123_LABEL) -> bool:
    return len(value) <= MAX_LABEL and pattern.match(value) is not None


def check_label(value: str, pattern: re.Pattern[str] = DNS1123_LABEL, first: str = "a letter or digit") -> str:
    """`value` when it is a DNS label of `pattern`, else ValueError saying what a name may be."""
    if not is_label(value, pattern):
        raise ValueError(
            f"{value!r} is not a valid name (a DNS label: at most {MAX_LABEL} characters "
            f"of a-z, 0-9 and '-', starting with {first} and ending with a letter or digit)"
        )
    return value


def pod_name(multiworld: str, member: str, ordinal: int) -> str:
    return f"{multiworld}-{member}-{ordinal}"


def spare_name(multiworld: str, member: str, serial: int) -> str:
    """`<mw>-<member>-spare-<serial in letters>`: a name ending in a letter is never a member
    pod's, whose ordinal is digits."""
    letters = ""
    serial += 1
    while serial > 0:
        serial, digit = divmod(serial - 1, 26)
        letters = chr(ord("a") + digit) + letters
    return f"{multiworld}-{member}-spare-{letters}"
