"""A device plugin for the test nodes: `nvidia.com/gpu` devices, as the scheduler and kubelet see GPUs.

The kubelet's device plugin API v1beta1 (api.proto beside this file) over unix sockets in the
node's device plugin folder (`/var/lib/kubelet/device-plugins`, private to each test node):

- the plugin serves `v1beta1.DevicePlugin` on its own socket there (SOCKET), then calls the
  kubelet's `v1beta1.Registration/Register` on `kubelet.sock` with that socket's name and the
  resource name;
- the kubelet dials it and opens ListAndWatch, which sends the devices (all Healthy) and then
  stays open; the kubelet advertises them as the Node's capacity and allocatable;
- as a container that asks for the resource is created, Allocate gets the device ids the kubelet
  chose and answers the environment that names them: NVIDIA_VISIBLE_DEVICES and
  CUDA_VISIBLE_DEVICES (no device node or mount: these GPUs are counted, not real);
- a restarted kubelet empties the folder (our socket goes) and makes a new `kubelet.sock`: the
  plugin sees either, serves again and registers again.

The device ids are the indices a CUDA program would see, "0" to "N-1", so the variables read as
they do on a GPU node. Run on a node (cluster.py starts it beside each kubelet):

    python -m tests.cluster.device_plugin [--devices 4] [--folder /var/lib/kubelet/device-plugins]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from tests.cluster.device_plugin import api_pb2, api_pb2_grpc

log = logging.getLogger("multiworld.device_plugin")

API_VERSION = "v1beta1"
RESOURCE = "nvidia.com/gpu"
FOLDER = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
SOCKET = "multiworld-gpu.sock"
DEFAULT_DEVICES = 4
HEALTHY = "Healthy"
VISIBLE_DEVICE_VARIABLES = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
# How often the plugin looks for a restarted kubelet, and how long it waits between tries to register.
POLL_S = 0.5
REGISTER_TIMEOUT_S = 5.0


def _device_order(device_id: str) -> tuple[int, str]:
    """Numeric ids in numeric order ("2" before "10"), anything else after them."""
    return (int(device_id), "") if device_id.isdigit() else (1 << 62, device_id)


class GpuPlugin(api_pb2_grpc.DevicePluginServicer):
    """The DevicePlugin service: `count` healthy devices with ids "0" to "count-1"."""

    def __init__(self, count: int = DEFAULT_DEVICES) -> None:
        if count < 0:
            raise ValueError(f"a node has no fewer than 0 devices, got {count}")
        self.device_ids = [str(index) for index in range(count)]
        # Set when the server this instance serves on stops: ListAndWatch streams end.
        self.stopping = threading.Event()

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        yield api_pb2.ListAndWatchResponse(
            devices=[api_pb2.Device(ID=device_id, health=HEALTHY) for device_id in self.device_ids]
        )
        # The devices never change: hold the stream open (the kubelet reads a closed one as the
        # plugin gone) until the kubelet hangs up or the server stops.
        while context.is_active() and not self.stopping.wait(POLL_S):
            pass

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        responses = []
        for asked in request.container_requests:
            chosen = list(dict.fromkeys(asked.must_include_deviceIDs))
            for device_id in sorted(asked.available_deviceIDs, key=_device_order):
                if len(chosen) >= asked.allocation_size:
                    break
                if device_id not in chosen:
                    chosen.append(device_id)
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        known = set(self.device_ids)
        responses = []
        for asked in request.container_requests:
            unknown = sorted(set(asked.devices_ids) - known)
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no such {RESOURCE} device: {', '.join(unknown)}")
            visible = ",".join(sorted(set(asked.devices_ids), key=_device_order))
            responses.append(api_pb2.ContainerAllocateResponse(envs=dict.fromkeys(VISIBLE_DEVICE_VARIABLES, visible)))
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def register(
    folder: Path, endpoint: str = SOCKET, resource: str = RESOURCE, timeout: float = REGISTER_TIMEOUT_S
) -> None:
    """Announce the plugin's socket to the kubelet serving `folder`/kubelet.sock (grpc.RpcError
    when none serves or it refuses)."""
    with grpc.insecure_channel(f"unix://{folder / KUBELET_SOCKET}") as channel:
        api_pb2_grpc.RegistrationStub(channel).Register(
            api_pb2.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint,
                resource_name=resource,
                options=api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
            ),
            timeout=timeout,
        )


@dataclass
class Serving:
    """One gRPC server of the plugin on its socket."""

    server: grpc.Server
    plugin: GpuPlugin
    socket: Path

    def stop(self) -> None:
        self.plugin.stopping.set()
        self.server.stop(grace=None).wait()
        self.socket.unlink(missing_ok=True)


def serve(folder: Path, count: int = DEFAULT_DEVICES, endpoint: str = SOCKET) -> Serving:
    """Serve a fresh GpuPlugin on `folder`/`endpoint` (a stale socket file there removed first)."""
    socket = folder / endpoint
    socket.unlink(missing_ok=True)
    plugin = GpuPlugin(count)
    # Each ListAndWatch stream holds a worker for as long as it lasts.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="device-plugin"))
    api_pb2_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return Serving(server, plugin, socket)


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file `path` is now (inode and change time), None when there is none."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_ino, status.st_ctime_ns


def run(folder: Path, count: int, stop: threading.Event, endpoint: str = SOCKET, resource: str = RESOURCE) -> None:
    """Serve and register, again whenever the kubelet restarts, until `stop` is set."""
    kubelet_socket = folder / KUBELET_SOCKET
    while not stop.is_set():
        kubelet = _identity(kubelet_socket)
        if kubelet is None:
            stop.wait(POLL_S)
            continue
        serving = serve(folder, count, endpoint)
        try:
            try:
                register(folder, endpoint, resource)
            except grpc.RpcError as error:
                log.info("no kubelet registered us yet (%s): trying again", error.code())
                stop.wait(POLL_S)
                continue
            log.info("registered %d %s devices with the kubelet as %s", count, resource, endpoint)
            # A restarted kubelet removes our socket and makes a new kubelet.sock: serve and
            # register again.
            while not stop.wait(POLL_S):
                if _identity(kubelet_socket) != kubelet or not serving.socket.exists():
                    log.info("the kubelet restarted: registering again")
                    break
        finally:
            serving.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=DEFAULT_DEVICES, help="how many devices (default 4)")
    parser.add_argument("--folder", type=Path, default=FOLDER, help="the kubelet's device plugin folder")
    parser.add_argument("--resource", default=RESOURCE, help="the extended resource served (default nvidia.com/gpu)")
    parser.add_argument("--socket", default=SOCKET, help="the plugin's socket, a name in the folder")
    args = parser.parse_args(argv)
    if args.devices < 0:
        parser.error("--devices must be 0 or more")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    log.info("pid %d: %d %s devices in %s", os.getpid(), args.devices, args.resource, args.folder)
    run(args.folder, args.devices, stop, args.socket, args.resource)
    return 0
