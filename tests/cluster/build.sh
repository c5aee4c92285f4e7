#!/usr/bin/env bash
# Ensure the test cluster binaries (control plane, node, kubectl) exist in the cache and print the cache folder on stdout.
#
# The folder follows the envtest layout (kube-apiserver, kube-controller-manager, etcd), so it can
# be used as KUBEBUILDER_ASSETS. etcd comes from Debian's etcd-server package; the kubernetes
# binaries are built once from Debian bookworm's kubernetes source package (no registry reachable
# here ships them) and reused until the Debian source version changes. The Debian packages it
# builds with come first, from packages.sh (a no-op when they are installed).
# Progress goes to stderr; a failing step prints its log tail.
set -euo pipefail

bash "$(dirname "${BASH_SOURCE[0]}")/packages.sh"

KUBE_DEBIAN_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
KUBE_GIT_VERSION="v1.20.2"
CACHE_ROOT="${MULTIWORLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/multiworld}"
DEST="$CACHE_ROOT/kube-$KUBE_DEBIAN_VERSION"
# Built together in one make (one compile cache): the control plane, the node and kubectl.
KUBE_COMMANDS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)
# What the cache holds: those, and the pod sandbox's `pause` from the same source.
KUBE_BINARIES=("${KUBE_COMMANDS[@]}" pause)

progress() { echo "kube-binaries: $*" >&2; }

WORK=""
cleanup() { if [ -n "$WORK" ]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT
work_dir() {
  if [ -z "$WORK" ]; then WORK="$(mktemp -d "${TMPDIR:-/tmp}/multiworld-kube-build.XXXXXX")"; fi
}

# Run a command with its output in a log; on failure show the tail and stop.
quietly() {
  work_dir
  local log="$WORK/step.log"
  if ! "$@" >"$log" 2>&1; then
    progress "FAILED: $*"
    tail -n 60 "$log" >&2
    exit 1
  fi
}

ensure_etcd() {
  mkdir -p "$DEST"
  ln -sfn "$(command -v etcd)" "$DEST/etcd"
}

fetch_source() {
  local apt_dir="$WORK/apt"
  mkdir -p "$apt_dir/lists/partial"
  # A private deb-src list: /etc/apt stays untouched.
  cat >"$apt_dir/sources.list" <<EOF
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
EOF
  local apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/nonexistent"
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::Archives=$WORK")
  quietly apt-get "${apt_opts[@]}" update
  (cd "$WORK" && quietly apt-get "${apt_opts[@]}" source --download-only "kubernetes=$KUBE_DEBIAN_VERSION")
  quietly dpkg-source -x "$WORK"/kubernetes_*.dsc "$WORK/src"
  rm -f "$WORK"/kubernetes_*.tar.* "$WORK"/kubernetes_*.dsc
}

# The vendored reflect2/json-iterator crash ("fatal error: fault") with Go 1.19 on the first
# custom-object create; Debian's packaged copies are the fixed versions.
replace_vendored_json_libraries() {
  local pkg
  for pkg in github.com/modern-go/reflect2 github.com/json-iterator/go; do
    rm -rf "$WORK/src/vendor/$pkg"
    cp -r "/usr/share/gocode/src/$pkg" "$WORK/src/vendor/$pkg"
    find "$WORK/src/vendor/$pkg" \( -name '*_test.go' -o -name go.mod -o -name go.sum \) -delete
    find "$WORK/src/vendor/$pkg" -depth -type d -name '*_tests' -exec rm -rf {} +
  done
  rm -rf "$WORK/src/vendor/github.com/json-iterator/go/benchmarks"
}

compile() {
  cat >"$WORK/version.env" <<EOF
KUBE_GIT_VERSION='$KUBE_GIT_VERSION'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
KUBE_GIT_TREE_STATE='archive'
EOF
  # The tree's own make (GOPATH mode, generated openapi code); a plain `go build` fails.
  (cd "$WORK/src" && quietly env PATH="/usr/lib/go-1.19/bin:$PATH" CGO_ENABLED=0 GOPROXY=off \
    GOFLAGS= GOCACHE="$WORK/gocache" KUBE_GIT_VERSION_FILE="$WORK/version.env" \
    make WHAT="${KUBE_COMMANDS[*]/#/cmd/}" GOLDFLAGS="-s -w")
  # The pod sandbox's process, packed into an image by node.py (static: the image holds nothing else).
  quietly gcc -Os -static -DVERSION=v1.20.2 -o "$WORK/src/_output/bin/pause" "$WORK/src/build/pause/linux/pause.c"
}

install_binaries() {
  local out="$WORK/src/_output/bin" name
  mkdir -p "$DEST"
  for name in "${KUBE_BINARIES[@]}"; do
    # Copy then rename, so an interrupted run never leaves a truncated binary in the cache.
    cp "$out/$name" "$DEST/.$name.partial"
    mv -f "$DEST/.$name.partial" "$DEST/$name"
  done
}

ensure_kube_binaries() {
  local name missing=0
  for name in "${KUBE_BINARIES[@]}"; do [ -x "$DEST/$name" ] || missing=1; done
  if [ "$missing" -eq 0 ]; then return; fi
  work_dir
  progress "building ${KUBE_BINARIES[*]} $KUBE_GIT_VERSION (Debian $KUBE_DEBIAN_VERSION) into $DEST"
  progress "downloading and unpacking the kubernetes source package"
  fetch_source
  replace_vendored_json_libraries
  progress "compiling (9 to 15 minutes on 2 cores; about 16 CPU-minutes)"
  local started=$SECONDS
  compile
  install_binaries
  progress "built in $((SECONDS - started)) s"
}

# One build at a time per cache: a concurrent caller waits, then finds the binaries in place.
mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.build.lock"
if ! flock -n 9; then
  progress "waiting for another build of the control plane binaries to finish"
  flock 9
fi
ensure_etcd
ensure_kube_binaries
echo "$DEST"
