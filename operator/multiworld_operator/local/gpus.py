"""GPUs for `multiworld run`: how many this machine has for the members' torch, and which one
each member process uses.

The runner imports no torch (the operator package must not need it): the count comes from a
short child process of the runner's own interpreter, the one python members run under, and
only where an NVIDIA driver is installed at all.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys

log = logging.getLogger(__name__)

_COUNT = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def cuda_device_count() -> int:
    """CUDA devices that torch sees here (0 without a driver, or with a CPU build of torch)."""
    if not (os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi")):
        return 0
    try:
        out = subprocess.run([sys.executable, "-c", _COUNT], capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("could not count CUDA devices with torch (%s): using none", exc)
        return 0


def gpu_env(pod: str, index: int, gpu_pods: int, devices: int) -> dict[str, str]:
    """The environment of member process `pod`, the index-th of `gpu_pods` processes in NCCL
    worlds on a machine with `devices` GPUs: its GPU (LOCAL_RANK, round-robin) and, when GPUs
    are shared, an NCCL host id of its own: NCCL refuses two ranks of one communicator on one
    GPU unless it takes them for separate hosts (they then talk over loopback sockets)."""
    env = {"LOCAL_RANK": str(index % devices)}
    if gpu_pods > devices:
        env["NCCL_HOSTID"] = f"{socket.gethostname()}-{pod}"
        env["NCCL_SOCKET_IFNAME"] = "lo"
    return env
