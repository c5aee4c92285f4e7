"""The operator and worker images, built from the Dockerfile and loaded into containerd.

From the repository root:

    python3 -m tests.cluster.images build                   # build or reuse the cached archive
    python3 -m tests.cluster.images load --address SOCKET   # import it into containerd (k8s.io)

The images are `multiworld/operator:dev` and `multiworld/worker:dev` (CRI sees them as
`docker.io/multiworld/...:dev`). This machine reaches only PyPI (through a TLS-intercepting proxy),
Debian and npm, so the build (root, minutes) uses:
- a Python base made with debootstrap (Debian's python 3.11 in a venv at /opt/venv, this
  machine's CA bundle as its system bundle), passed as the Dockerfile's PYTHON_IMAGE, with
  PIP_CERT naming that bundle;
- a local index serving the CPU torch wheel from pip's find-links folder, as TORCH_INDEX_URL;
- a private dockerd (classic builder), stopped and deleted once the images are saved.

Cached under ~/.cache/multiworld/images/ (or $MULTIWORLD_CACHE/images/): the base as a rootfs tar,
keyed by suite, packages and CA bundle; both images as one `docker save` tar, keyed by the build
inputs and the base key; beside it a JSON file with the image ids. Tars are zstd-compressed when
zstd is installed. A warm run needs no dockerd: `load` imports the tar with ctr, or does nothing
when containerd already holds both images with the same ids.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

log = logging.getLogger("multiworld.test_images")

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
IMAGES = ("multiworld/operator:dev", "multiworld/worker:dev")
# Where the chart's and the examples' default images live (their tag is the project's version).
PUBLISHED_REGISTRY = "ghcr.io"
TARGETS = {"multiworld/operator:dev": "operator", "multiworld/worker:dev": "worker"}

SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "iproute2", "procps")
BASE_CA = "/etc/ssl/certs/ca-certificates.crt"  # in the base: this machine's bundle
BASE_CHANGES = (
    "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV VIRTUAL_ENV=/opt/venv",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)
# Bump when the recipe below changes in a way the keys do not see.
BASE_RECIPE = "2"
IMAGES_RECIPE = "1"
# The build context: what the Dockerfile copies, and the images' key. README.md, copied too, only
# fills the wheel's description, so it is left out of the key.
CONTEXT_INPUTS = ("Dockerfile", ".dockerignore", "pyproject.toml", "constraints.txt", "worker", "operator", "examples")
UNKEYED_INPUTS = ("README.md",)
DEFAULT_WHEEL_DIR = Path("/opt/wheels")
DOCKER = Path("/usr/bin/docker")  # Debian's client; /usr/local/bin/docker may be another one
HEARTBEAT_S = 30.0


class ImageError(RuntimeError):
    """The images could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    xdg_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = Path(os.environ.get("MULTIWORLD_CACHE") or xdg_cache / "multiworld") / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _zstd() -> str | None:
    return shutil.which("zstd")


def _suffix() -> str:
    return ".tar.zst" if _zstd() else ".tar"


@functools.cache
def _pip_config() -> dict[str, str]:
    """This machine's pip settings (`pip config list`), keyed without their scope: cert, find-links, ..."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    settings: dict[str, str] = {}
    for line in result.stdout.splitlines():
        match = re.fullmatch(r"[^.]*\.([\w-]+)='(.*)'", line.strip())
        if match:
            settings.setdefault(match.group(1), match.group(2))
    return settings


def host_ca_bundle() -> Path | None:
    """The CA bundle pip trusts here (the proxy's CA is in it), if pip is told of one."""
    cert = os.environ.get("PIP_CERT") or _pip_config().get("cert")
    return Path(cert) if cert and Path(cert).is_file() else None


def pinned_torch() -> str:
    text = (REPO_ROOT / "constraints.txt").read_text()
    match = re.search(r"^torch==(\S+)", text, re.MULTILINE)
    if not match:
        raise ImageError("constraints.txt pins no torch version")
    return match.group(1)


def local_torch_wheel() -> Path | None:
    """The pinned CPU torch wheel for the base's python (3.11) in pip's find-links folders."""
    folders = (os.environ.get("PIP_FIND_LINKS") or _pip_config().get("find-links") or "").split()
    pattern = f"torch-{pinned_torch()}+cpu-cp311-cp311-*x86_64.whl"
    for folder in [*map(Path, folders), DEFAULT_WHEEL_DIR]:
        found = sorted(folder.glob(pattern)) if folder.is_dir() else []
        if found:
            return found[-1]
    return None


def _digest(parts: Sequence[str | bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:16]


def base_key() -> str:
    ca = host_ca_bundle()
    return _digest([BASE_RECIPE, SUITE, *BASE_PACKAGES, *BASE_CHANGES, ca.read_bytes() if ca else b""])


def _context_files(root: Path, names: Sequence[str]) -> Iterator[Path]:
    """Files of the named inputs, skipping what .dockerignore keeps out (caches, egg-info)."""
    for name in names:
        path = root / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            parts = file.relative_to(root).parts
            if not any(p == "__pycache__" or p.endswith((".pyc", ".egg-info")) for p in parts):
                yield file


def images_key(context: Path = REPO_ROOT) -> str:
    wheel = local_torch_wheel()
    parts: list[str | bytes] = [IMAGES_RECIPE, base_key(), wheel.name if wheel else "index"]
    for file in _context_files(context, CONTEXT_INPUTS):
        parts += [file.relative_to(context).as_posix(), file.read_bytes()]
    return _digest(parts)


def _snapshot_context(dest: Path) -> Path:
    """A copy of the build context: others may edit the tree while the images build."""
    for file in _context_files(REPO_ROOT, CONTEXT_INPUTS + UNKEYED_INPUTS):
        target = dest / file.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file, target)
    return dest


# ---- processes ------------------------------------------------------------------------------


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], what: str, log_file: Path | None) -> None:
    """Wait for a pipeline, logging a line every HEARTBEAT_S seconds; raise if any part failed."""
    started = next_beat = time.monotonic()
    while any(p.poll() is None for p in procs):
        time.sleep(0.5)
        if time.monotonic() - next_beat >= HEARTBEAT_S:
            next_beat = time.monotonic()
            log.info("  still %s (%.0f s)", what, next_beat - started)
    failed = [(p.args, p.returncode) for p in procs if p.returncode != 0]
    if failed:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-40:]) if log_file else ""
        raise ImageError(f"{what} failed: {failed}\n{tail}")


def _pipeline(
    commands: Sequence[Sequence[str | Path]],
    what: str,
    *,
    log_file: Path,
    stdin: IO[bytes] | None = None,
    stdout: IO[bytes] | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run `a | b | ...`, stderr (and the last stdout unless given) appended to log_file."""
    procs: list[subprocess.Popen[bytes]] = []
    with open(log_file, "ab") as sink:
        source = stdin
        for index, command in enumerate(commands):
            last = index == len(commands) - 1
            proc = subprocess.Popen(
                [str(c) for c in command],
                stdin=source if source is not None else subprocess.DEVNULL,
                stdout=(stdout or sink) if last else subprocess.PIPE,
                stderr=sink,
                env=env,
            )
            if source is not None and source is not stdin:
                source.close()  # the next process holds it now
            source = proc.stdout
            procs.append(proc)
        try:
            _wait_all(procs, what, log_file)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _decompress(path: Path) -> list[str]:
    return [_zstd() or "zstd", "-dc", str(path)] if path.name.endswith(".zst") else ["cat", str(path)]


def _compress() -> list[str]:
    zstd = _zstd()
    return [zstd, "-q", "-T0", "-3"] if zstd else ["cat"]


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    return sorted((p for p in points if p == prefix or p.startswith(prefix + "/")), key=len, reverse=True)


def _remove_tree(path: Path) -> None:
    for point in _mounts_under(path):
        subprocess.run(["umount", "-l", point], check=False)
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    with open(cache_dir() / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another build holds %s; waiting for it", lock.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# ---- the base -------------------------------------------------------------------------------


def ensure_base_archive(work: Path, log_file: Path) -> Path:
    """The debootstrap rootfs tar for the current base key, built when missing (root, 1-3 min)."""
    archive = cache_dir() / f"base-{SUITE}-{base_key()}{_suffix()}"
    if archive.exists():
        return archive
    if not shutil.which("debootstrap"):
        raise ImageError("debootstrap is missing: bash tests/cluster/packages.sh installs it")
    rootfs = work / "rootfs"
    log.info("making the %s Python base with debootstrap (1-3 minutes; log: %s)", SUITE, log_file)
    started = time.monotonic()
    try:
        _pipeline(
            [["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, rootfs]],
            "debootstrap",
            log_file=log_file,
        )
        _pipeline(
            [["chroot", rootfs, "/usr/bin/python3", "-m", "venv", "/opt/venv"]], "creating the venv", log_file=log_file
        )
        ca = host_ca_bundle()
        if ca:
            shutil.copyfile(ca, rootfs / BASE_CA.lstrip("/"))
        for junk in (
            "var/cache/apt/archives",
            "var/lib/apt/lists",
            "usr/share/doc",
            "usr/share/man",
            "usr/share/info",
            "usr/share/locale",
        ):
            for entry in (rootfs / junk).glob("*"):
                if entry.is_file() or entry.is_symlink():
                    entry.unlink()
                elif entry.is_dir():
                    shutil.rmtree(entry)
        partial = archive.with_name(archive.name + ".partial")
        with open(partial, "wb") as out:
            _pipeline([["tar", "-C", rootfs, "--numeric-owner", "--exclude=./dev/*", "--exclude=./proc/*",
                        "--exclude=./sys/*", "--exclude=./etc/resolv.conf", "-cf", "-", "."], _compress()],
                      "packing the base", log_file=log_file, stdout=out)  # fmt: skip
        partial.rename(archive)
    finally:
        _remove_tree(rootfs)
    for stale in cache_dir().glob(f"base-{SUITE}-*"):
        if stale != archive:
            stale.unlink()
    log.info("base ready in %.0f s: %s (%.0f MB)", time.monotonic() - started, archive, archive.stat().st_size / 1e6)
    return archive


# ---- a private dockerd ----------------------------------------------------------------------


class Docker:
    """A dockerd of our own (no iptables, no bridge: build and run with host or no network)."""

    def __init__(self, work: Path, log_file: Path) -> None:
        self.work = work
        # Sockets live under a short path (the unix socket limit is 108 bytes).
        self.run_dir = Path(tempfile.mkdtemp(prefix="mw-docker-"))
        self.socket = self.run_dir / "docker.sock"
        self.log_file = log_file
        self.proc: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, "DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": str(self.run_dir / "client")}

    def start(self, timeout: float = 60.0) -> None:
        dockerd = shutil.which("dockerd")
        if not dockerd or not DOCKER.exists():
            raise ImageError("dockerd or /usr/bin/docker is missing: bash tests/cluster/packages.sh installs them")
        (self.run_dir / "daemon.json").write_text("{}")
        argv = [dockerd, f"--host=unix://{self.socket}", f"--data-root={self.work / 'docker'}",
                f"--exec-root={self.run_dir / 'exec'}", f"--pidfile={self.run_dir / 'dockerd.pid'}",
                f"--config-file={self.run_dir / 'daemon.json'}", "--iptables=false", "--bridge=none"]  # fmt: skip
        with open(self.log_file, "ab") as sink:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        deadline = time.monotonic() + timeout
        while subprocess.run(self.argv("version"), capture_output=True, env=self.env, check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ImageError(f"dockerd did not start; see {self.log_file}")
            time.sleep(0.5)

    def argv(self, *args: str | Path) -> list[str]:
        return [str(DOCKER), "-H", f"unix://{self.socket}", *map(str, args)]

    def output(self, *args: str | Path) -> str:
        result = subprocess.run(self.argv(*args), capture_output=True, text=True, env=self.env, check=False)
        if result.returncode != 0:
            raise ImageError(f"docker {' '.join(map(str, args))} failed: {result.stderr.strip()}")
        return result.stdout

    def stop(self) -> None:
        """Stop dockerd (it stops its containerd), then remove its folders and data."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._stop_orphaned_containerd()
        _remove_tree(self.run_dir)
        _remove_tree(self.work / "docker")

    def _stop_orphaned_containerd(self) -> None:
        """The containerd a killed dockerd leaves behind (its command line names our run folder)."""
        with contextlib.suppress(OSError, ValueError):
            pid = int((self.run_dir / "exec" / "containerd" / "containerd.pid").read_text())
            if str(self.run_dir) in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM it when we die, however we die (dockerd then stops cleanly)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def _running_docker(work: Path, log_file: Path) -> Iterator[Docker]:
    docker = Docker(work, log_file)
    try:
        docker.start()
        yield docker
    finally:
        docker.stop()


@contextlib.contextmanager
def _torch_index(wheel: Path, work: Path) -> Iterator[str]:
    """A PEP 503 index on loopback whose only project is torch, holding this one wheel."""
    root = work / "index"
    (root / "torch").mkdir(parents=True, exist_ok=True)
    link = root / "torch" / wheel.name
    link.unlink(missing_ok=True)
    link.symlink_to(wheel)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


# ---- the images -----------------------------------------------------------------------------


def archive_image_ids(archive: Path) -> dict[str, str]:
    """{image name: image id} of a cached archive, from the JSON file beside it."""
    return dict(json.loads(_ids_file(archive).read_text())["ids"])


def _ids_file(archive: Path) -> Path:
    return archive.with_name(archive.name.split(".tar")[0] + ".json")


def _archive(key: str) -> Path:
    return cache_dir() / f"multiworld-{key}{_suffix()}"


def _complete(archive: Path) -> bool:
    return archive.exists() and _ids_file(archive).exists()


def ensure_image_archive() -> Path:
    """The cached `docker save` tar of both images for the current sources, built when missing."""
    archive = _archive(images_key())
    if _complete(archive):
        log.info("images cached: %s", archive)
        return archive
    with _build_lock():
        for leftover in cache_dir().glob("build-*"):  # from a build that was killed
            _remove_tree(leftover)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=cache_dir()))
        try:
            # Keyed and built from one snapshot, so the archive holds exactly what its key says.
            context = _snapshot_context(work / "context")
            archive = _archive(images_key(context))
            if not _complete(archive):  # another build may have made it while we waited
                _build_images(archive, work, context)
        finally:
            _remove_tree(work)
        for stale in cache_dir().glob("multiworld-*"):
            if not stale.name.startswith(archive.name.split(".tar")[0] + "."):
                stale.unlink()
    return archive


def _build_images(archive: Path, work: Path, context: Path) -> None:
    if os.geteuid() != 0:
        raise ImageError("building the images needs root (debootstrap, dockerd)")
    started = time.monotonic()
    # The logs of the last build stay in the cache, for a look after a failure.
    build_log, dockerd_log = cache_dir() / "last-build.log", cache_dir() / "last-dockerd.log"
    build_log.write_bytes(b"")
    dockerd_log.write_bytes(b"")
    base = ensure_base_archive(work, build_log)
    wheel = local_torch_wheel()
    ca = host_ca_bundle()
    with _running_docker(work, dockerd_log) as docker, contextlib.ExitStack() as stack:
        base_image = f"multiworld/python-base:{base_key()}"
        log.info("importing the base into a private dockerd")
        changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
        _pipeline(
            [_decompress(base), docker.argv("import", *changes, "-", base_image)],
            "importing the base",
            log_file=build_log,
            env=docker.env,
        )
        build_args = {"PYTHON_IMAGE": base_image, **({"PIP_CERT": BASE_CA} if ca else {})}
        worker_args = {"TORCH_INDEX_URL": stack.enter_context(_torch_index(wheel, work))} if wheel else {}
        for name, target in TARGETS.items():
            log.info("building %s (target %s; the worker takes 1-3 minutes; log: %s)", name, target, build_log)
            args = {**build_args, **(worker_args if target == "worker" else {})}
            flags = [arg for key, value in args.items() for arg in ("--build-arg", f"{key}={value}")]
            _pipeline([docker.argv("build", "--network=host", "--target", target, "-t", name, *flags,
                                   "-f", context / "Dockerfile", context)],
                      f"building {name}", log_file=build_log, env=docker.env)  # fmt: skip
        _smoke_test(docker)
        ids = {name: docker.output("image", "inspect", "-f", "{{.Id}}", name).strip() for name in IMAGES}
        sizes = {name: int(docker.output("image", "inspect", "-f", "{{.Size}}", name)) for name in IMAGES}
        log.info("saving the images to %s", archive)
        partial = archive.with_name(archive.name + ".partial")
        with open(partial, "wb") as out:
            _pipeline(
                [docker.argv("save", *IMAGES), _compress()],
                "saving the images",
                log_file=build_log,
                stdout=out,
                env=docker.env,
            )
    record = {"ids": ids, "sizes": sizes, "torch_wheel": wheel.name if wheel else None}
    _ids_file(archive).write_text(json.dumps(record, indent=2))
    partial.rename(archive)
    log.info(
        "images built in %.0f s: %s; %s (archive %.0f MB)",
        time.monotonic() - started,
        ", ".join(f"{n} {s / 1e6:.0f} MB" for n, s in sizes.items()),
        archive.name,
        archive.stat().st_size / 1e6,
    )


def _smoke_test(docker: Docker) -> None:
    """Each image does its job: the worker imports torch (the pinned CPU build) and the library,
    the operator's entrypoint answers --help and it has no torch."""
    probe = "import torch, multiworld, multiworld.channels.stream; print(torch.__version__, torch.version.cuda)"
    worker = docker.output("run", "--rm", "--network=none", "multiworld/worker:dev", "python", "-c", probe).split()
    if worker != [f"{pinned_torch()}+cpu", "None"]:
        raise ImageError(f"the worker image's torch is {worker}, expected {pinned_torch()}+cpu without CUDA")
    docker.output("run", "--rm", "--network=none", "multiworld/operator:dev", "--help")
    no_torch = subprocess.run(
        docker.argv(
            "run", "--rm", "--network=none", "--entrypoint", "python", "multiworld/operator:dev", "-c", "import torch"
        ),
        capture_output=True,
        env=docker.env,
        check=False,
    )
    if no_torch.returncode == 0:
        raise ImageError("the operator image has torch")
    log.info("smoke test passed: worker torch %s, operator --help, operator without torch", worker[0])


# ---- containerd -----------------------------------------------------------------------------


def _ctr(address: str, *args: str) -> list[str]:
    return ["ctr", "--address", address, "--connect-timeout", "10s", "--namespace", "k8s.io", *args]


def containerd_image_ids(address: str) -> dict[str, str]:
    """{name as docker names it: image id (config digest)} of our images in containerd."""
    listing = subprocess.run(_ctr(address, "images", "ls"), capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        raise ImageError(f"ctr images ls at {address} failed: {listing.stderr.strip()}")
    ids: dict[str, str] = {}
    for line in listing.stdout.splitlines()[1:]:
        ref, _, digest = line.split()[:3]
        name = ref.removeprefix("docker.io/")
        if name in IMAGES:
            manifest = subprocess.run(_ctr(address, "content", "get", digest), capture_output=True, check=False)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                ids[name] = json.loads(manifest.stdout)["config"]["digest"]
    return ids


def load_images(containerd_address: str) -> None:
    """Import the images into containerd's k8s.io namespace unless it holds them already; also
    name them as the chart's and the examples' defaults do (ghcr.io/multiworld/...:<version>),
    so that `helm install` and `kubectl apply -f examples/...` run them here unchanged."""
    archive = ensure_image_archive()
    wanted = archive_image_ids(archive)
    if containerd_image_ids(containerd_address) == wanted:
        log.info("containerd at %s already holds both images", containerd_address)
    else:
        _import(archive, containerd_address, wanted)
    for name in IMAGES:
        published = f"{PUBLISHED_REGISTRY}/{name.split(':')[0]}:{_project_version()}"
        subprocess.run(_ctr(containerd_address, "images", "tag", "--force", f"docker.io/{name}", published),
                       capture_output=True, check=True)  # fmt: skip


def _project_version() -> str:
    for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise ImageError("pyproject.toml names no version")


def _import(archive: Path, containerd_address: str, wanted: dict[str, str]) -> None:
    started = time.monotonic()
    log.info("importing %s into containerd (1-2 minutes)", archive.name)
    with tempfile.NamedTemporaryFile(prefix="mw-ctr-import-", suffix=".log") as log_file:
        _pipeline(
            [_decompress(archive), _ctr(containerd_address, "images", "import", "-")],
            "importing into containerd",
            log_file=Path(log_file.name),
        )
    loaded = containerd_image_ids(containerd_address)
    if loaded != wanted:
        raise ImageError(f"after the import containerd holds {loaded}, expected {wanted}")
    log.info("loaded %s in %.0f s", ", ".join(f"docker.io/{name}" for name in IMAGES), time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="images.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build or reuse the cached image archive; print its path")
    load = commands.add_parser("load", help="import the images into containerd (building them if needed)")
    load.add_argument("--address", required=True, help="containerd's socket")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="images: %(message)s")
    try:
        if args.command == "build":
            print(ensure_image_archive())
        else:
            load_images(str(Path(args.address).absolute()))
    except ImageError as error:
        log.error("%s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
