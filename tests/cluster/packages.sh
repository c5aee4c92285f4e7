#!/usr/bin/env bash
# The Debian packages the test cluster and the image build need: the one list, and the one step
# that installs them. Every other setup step (build.sh, images.py, node.py) runs after it.
#
#   bash tests/cluster/packages.sh          # install whatever is missing (idempotent; root or sudo)
#   bash tests/cluster/packages.sh list     # print the list, one package a line
#
# With everything installed it runs no apt and needs no root. When something is missing and
# cannot be installed here (no apt-get, not root and no sudo), it stops with one line naming
# what is missing and the command that installs it.
set -euo pipefail

# The nodes (node.py, nodes.py): container runtime, pod network plugins, iptables tools, DNS
# server, and `ip` for their namespaces, links and routes.
NODE=(containerd runc containernetworking-plugins iptables conntrack dnsmasq-base iproute2)
# The control plane's store (cluster.py starts its own etcd on free ports).
CONTROL_PLANE=(etcd-server)
# What images.py builds our images with: a Debian base, a Docker engine, compressed caches.
IMAGES=(debootstrap docker.io zstd)
# What tests/ scrape the operator and workers with, and check the dashboard's queries against.
MONITORING=(prometheus)
# What build.sh compiles the kubernetes binaries with (Debian's packaged reflect2 and
# json-iterator replace the source's vendored copies).
KUBE_BUILD=(golang-1.19-go rsync jq make dpkg-dev openssl gcc libc6-dev
  golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev)
PACKAGES=("${NODE[@]}" "${CONTROL_PLANE[@]}" "${IMAGES[@]}" "${MONITORING[@]}" "${KUBE_BUILD[@]}")

if [ "${1:-}" = list ]; then
  printf '%s\n' "${PACKAGES[@]}"
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "usage: $0 [list]" >&2
  exit 2
fi

# One query for all (a package never installed is absent from its answer).
installed=" $(dpkg-query -W -f='${db:Status-Abbrev}${Package} ' "${PACKAGES[@]}" 2>/dev/null |
  grep -o 'ii [^ ]*' | cut -c4- | tr '\n' ' ' || true) "
missing=()
for package in "${PACKAGES[@]}"; do
  if [[ "$installed" != *" $package "* ]]; then missing+=("$package"); fi
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi

install_command="apt-get install -y --no-install-recommends ${missing[*]}"
SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    echo "packages: missing ${missing[*]} (not root, no sudo); install them with: sudo $install_command" >&2
    exit 1
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "packages: missing ${missing[*]} and no apt-get here; install the equivalents of: $install_command" >&2
  exit 1
fi

echo "packages: installing from Debian: ${missing[*]}" >&2
log="$(mktemp "${TMPDIR:-/tmp}/multiworld-packages.XXXXXX")"
trap 'rm -f "$log"' EXIT
apt_env=(env DEBIAN_FRONTEND=noninteractive)
# The package lists are refreshed only when the first attempt fails: a new machine has none,
# and a machine that has them should not pay for an update.
if ! "${SUDO[@]}" "${apt_env[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
  if ! { "${SUDO[@]}" "${apt_env[@]}" apt-get update -q &&
    "${SUDO[@]}" "${apt_env[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "packages: installing ${missing[*]} failed (log above); the command was: $install_command" >&2
    exit 1
  fi
fi
