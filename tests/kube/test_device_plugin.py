"""The test nodes' device plugin (tests/cluster/device_plugin) speaking the kubelet's device plugin
API v1beta1 over real unix sockets with a kubelet's side of the protocol written here with grpcio:
a Registration server on kubelet.sock that, as the kubelet does, dials the plugin's socket on
Register, asks its options and opens ListAndWatch. On a real node: tests/kube/test_node_gpus.py."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from tests.cluster.device_plugin import api_pb2, api_pb2_grpc, plugin

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 10.0


@dataclass
class Registered:
    """What a kubelet learns from one registration: the request, the plugin's options, the first
    device list of its ListAndWatch stream, and a client of the plugin's socket."""

    request: api_pb2.RegisterRequest
    options: api_pb2.DevicePluginOptions
    devices: list[api_pb2.Device]
    plugin: api_pb2_grpc.DevicePluginStub


class Kubelet(api_pb2_grpc.RegistrationServicer):
    """The kubelet's side: Registration on `folder`/kubelet.sock; on Register it answers at once,
    then dials the plugin's endpoint in the same folder, asks GetDevicePluginOptions and opens
    ListAndWatch (held open, as the kubelet holds it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.registered: queue.Queue[Registered | Exception] = queue.Queue()
        self._channels: list[grpc.Channel] = []
        self._streams: list[grpc.Future] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{folder / plugin.KUBELET_SOCKET}")

    def start(self) -> Kubelet:
        self._server.start()
        return self

    def stop(self) -> None:
        for stream in self._streams:
            stream.cancel()
        self._server.stop(grace=None).wait()
        for channel in self._channels:
            channel.close()

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        threading.Thread(target=self._dial, args=(request,), daemon=True).start()
        return api_pb2.Empty()

    def _dial(self, request: api_pb2.RegisterRequest) -> None:
        try:
            channel = grpc.insecure_channel(f"unix://{self.folder / request.endpoint}")
            self._channels.append(channel)
            stub = api_pb2_grpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=WAIT_S)
            stream = stub.ListAndWatch(api_pb2.Empty())
            self._streams.append(stream)
            first = next(stream)
            self.registered.put(Registered(request, options, list(first.devices), stub))
        except Exception as error:  # the test reads it from the queue
            self.registered.put(error)

    def next_registration(self) -> Registered:
        try:
            got = self.registered.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"no plugin registered within {WAIT_S:.0f} s") from None
        if isinstance(got, Exception):
            raise got
        return got


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A device plugin folder (a short path: unix socket names are limited to about 100 bytes)."""
    path = tmp_path / "device-plugins"
    path.mkdir()
    return path


@pytest.fixture
def kubelet(folder: Path) -> Iterator[Kubelet]:
    serving = Kubelet(folder).start()
    yield serving
    serving.stop()


def run_plugin(folder: Path, count: int = plugin.DEFAULT_DEVICES) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=plugin.run, args=(folder, count, stop), daemon=True)
    thread.start()
    return stop, thread


@pytest.fixture
def plugin_run(folder: Path) -> Iterator[None]:
    stop, thread = run_plugin(folder)
    yield
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()


def allocate(stub: api_pb2_grpc.DevicePluginStub, *containers: list[str]) -> list[dict[str, str]]:
    response = stub.Allocate(
        api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=c) for c in containers]
        ),
        timeout=WAIT_S,
    )
    return [dict(container.envs) for container in response.container_responses]


@pytest.mark.usefixtures("plugin_run")
def test_registers_lists_four_healthy_gpus_and_allocates_their_ids(kubelet: Kubelet, folder: Path) -> None:
    registered = kubelet.next_registration()
    assert (registered.request.version, registered.request.resource_name) == ("v1beta1", "nvidia.com/gpu")
    assert registered.request.endpoint == plugin.SOCKET and (folder / plugin.SOCKET).is_socket()
    assert [(d.ID, d.health) for d in registered.devices] == [(str(i), "Healthy") for i in range(4)]
    assert registered.options.get_preferred_allocation_available and not registered.options.pre_start_required

    # One container given one device, another given two (in the kubelet's order, not sorted).
    one, two = allocate(registered.plugin, ["2"], ["3", "0"])
    assert one == {"NVIDIA_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "2"}
    assert two == {"NVIDIA_VISIBLE_DEVICES": "0,3", "CUDA_VISIBLE_DEVICES": "0,3"}
    with pytest.raises(grpc.RpcError) as refused:
        allocate(registered.plugin, ["7"])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    preferred = registered.plugin.GetPreferredAllocation(
        api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=["3", "1", "2"], must_include_deviceIDs=["2"], allocation_size=2
                )
            ]
        ),
        timeout=WAIT_S,
    )
    assert [list(c.deviceIDs) for c in preferred.container_responses] == [["2", "1"]]
    registered.plugin.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=["1"]), timeout=WAIT_S)


@pytest.mark.usefixtures("plugin_run")
def test_registers_again_with_a_restarted_kubelet(kubelet: Kubelet, folder: Path) -> None:
    kubelet.next_registration()
    kubelet.stop()
    # A starting kubelet empties the folder (the plugin's socket too), then serves kubelet.sock anew.
    for stale in folder.iterdir():
        stale.unlink()
    restarted = Kubelet(folder).start()
    try:
        registered = restarted.next_registration()
        assert len(registered.devices) == 4 and (folder / plugin.SOCKET).is_socket()
        assert allocate(registered.plugin, ["1"]) == [{"NVIDIA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}]
    finally:
        restarted.stop()


def test_waits_for_a_kubelet_that_starts_later(folder: Path) -> None:
    stop, thread = run_plugin(folder, count=2)
    try:
        late = Kubelet(folder).start()
        try:
            assert [d.ID for d in late.next_registration().devices] == ["0", "1"]
        finally:
            late.stop()
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and not (folder / plugin.SOCKET).exists()


def test_the_command_takes_a_device_count_and_stops_on_sigterm(kubelet: Kubelet, folder: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.cluster.device_plugin", f"--folder={folder}", "--devices=8"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        registered = kubelet.next_registration()
        assert [d.ID for d in registered.devices] == [str(i) for i in range(8)]
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=WAIT_S)
    assert process.returncode == 0, output
    assert not (folder / plugin.SOCKET).exists()


def test_the_committed_modules_match_the_proto(tmp_path: Path) -> None:
    """api_pb2*.py(i) are grpcio-tools' output for api.proto (regenerate them as api.proto says)."""
    source = "tests/cluster/device_plugin/api.proto"
    (tmp_path / source).parent.mkdir(parents=True)
    (tmp_path / source).write_bytes((REPO / source).read_bytes())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            source,
        ],
        cwd=tmp_path,
        check=True,
    )
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        generated = (tmp_path / source).with_name(name).read_text()
        assert generated == (REPO / source).with_name(name).read_text(), f"{name} is stale: regenerate it"
