"""A worker's link to the operator as the tests and benches use it on a control plane with no
node: the worker library's own channel (multiworld.channels.stream) for one pod, opened with a
real token the API server binds to that pod (TokenRequest, our audience), so the operator checks
it with a TokenReview exactly as it checks a pod's mounted token. Where the operator is, the
pod's own environment says (MULTIWORLD_TABLE, as the operator wrote it)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from multiworld.channels.stream import StreamChannel, parse_url
from multiworld.contract import (
    ENV_TABLE,
    TOKEN_AUDIENCE,
    BrokenWorldReport,
    ChannelMessage,
    Hello,
    WorkerStatus,
    WorldTable,
)

TOKEN_LIFETIME_S = 3600


def pod_token(core: client.CoreV1Api, namespace: str, pod: str) -> str:
    """A token of the pod's ServiceAccount bound to that pod (the kubelet mounts such a one)."""
    found: Any = core.read_namespaced_pod(pod, namespace)
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[TOKEN_AUDIENCE],
            expiration_seconds=TOKEN_LIFETIME_S,
            bound_object_ref=client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod, uid=found.metadata.uid
            ),
        )
    )
    account = found.spec.service_account_name or "default"
    issued: Any = core.create_namespaced_service_account_token(account, namespace, request)
    return str(issued.status.token)


def channel_url(core: client.CoreV1Api, namespace: str, pod: str) -> str:
    """Where the operator told that pod to connect (its container's MULTIWORLD_TABLE)."""
    found: Any = core.read_namespaced_pod(pod, namespace)
    (value,) = [e.value for e in found.spec.containers[0].env if e.name == ENV_TABLE]
    return str(value)


def hello_answer(host: str, port: int, hello: Hello, timeout: float) -> ChannelMessage:
    """What the operator's channel at host:port answers a raw connection that opens with `hello`."""
    with socket.create_connection((host, port), timeout=timeout) as sock, sock.makefile("rb") as lines:
        sock.sendall(ChannelMessage(hello=hello).encode())
        return ChannelMessage.decode(lines.readline())


class WorkerLink:
    """Use as a context manager: the channel of `pod` (speaking with `token`, its own by default),
    the tables it received, and how many bytes they came in."""

    def __init__(self, core: client.CoreV1Api, namespace: str, pod: str, folder: Path, token: str = "") -> None:
        _, host, port = parse_url(channel_url(core, namespace, pod))
        self.token_file = folder / f"{pod}.token"
        self.token_file.write_text(token or pod_token(core, namespace, pod))
        self.channel = StreamChannel(host, port, pod, self.token_file)
        self.tables: list[WorldTable] = []
        self.bytes_received = 0
        self._arrived = threading.Condition()

    def __enter__(self) -> WorkerLink:
        self.channel.start(self._on_table)
        return self

    def __exit__(self, *_: object) -> None:
        self.channel.close()

    def _on_table(self, table: WorldTable) -> None:
        with self._arrived:
            self.tables.append(table)
            self.bytes_received += len(ChannelMessage(table=table).encode())
            self._arrived.notify_all()

    def status(self, status: WorkerStatus) -> None:
        self.channel.status(status)

    def report(self, report: BrokenWorldReport) -> None:
        self.channel.report(report)

    def wait_table(self, timeout: float) -> WorldTable:
        """The latest table, waiting up to `timeout` for the first."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while not self.tables:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no table reached {self.channel!r} in {timeout:g}s")
                self._arrived.wait(left)
            return self.tables[-1]
