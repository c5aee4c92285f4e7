"""Where a world's host is looked up: a name beside this pod's own is asked for by its full name.

The operator names rank 0's pod relative to the MultiWorld's headless Service (`<pod>.<mw>`),
which the resolver completes through the pod's search list. Until a new pod's record exists
every name on that list is unknown, and the resolver then asks for the bare name, which leaves
the cluster: the kept members of a world whose rank 0 was just replaced would wait on the cluster
DNS's upstream, however long that takes to say it does not know the name (a lost answer costs
the resolver's whole timeout, 5 s by default). The kubelet writes this pod's own full name into
/etc/hosts (`<pod>.<mw>.<ns>.svc.<domain>`), so a host in the same subdomain (or a parent of
it, as `<pod>.<mw>.<ns>`) is asked for absolutely, and only the cluster's DNS answers: at once,
whether the record exists yet or not. Any other host (an address, `localhost`, a name elsewhere)
is left as given. No torch at import.
"""

from __future__ import annotations

import functools
import ipaddress
import socket


def absolute(host: str, own_name: str) -> str:
    """`host` with its domain completed from `own_name` (this machine's full name) when the
    domain it names is the first labels of `own_name`'s, as an absolute name (a trailing dot);
    otherwise `host` unchanged."""
    if not _relative_name(host):
        return host
    first, _, domain = host.partition(".")
    own_domain = own_name.rstrip(".").partition(".")[2]
    if own_domain != domain and not own_domain.startswith(domain + "."):
        return host
    return f"{first}.{own_domain}."


def qualified(host: str) -> str:
    """`host` as this machine looks it up (see `absolute`); only a relative name with a domain
    asks for this machine's own name."""
    return absolute(host, _own_name()) if _relative_name(host) else host


@functools.cache
def _own_name() -> str:
    return socket.getfqdn()


def _relative_name(host: str) -> bool:
    """Whether `host` is a name with a domain (a dot inside it) and no trailing dot."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        first, _, domain = host.partition(".")
        return bool(first) and bool(domain) and not domain.endswith(".")
    return False
