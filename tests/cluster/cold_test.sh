#!/usr/bin/env bash
# The cold path, checked on this machine: take away what a new machine lacks, then run `make demo`
# and `.ci/run` in fresh clones of the committed HEAD (with ../shared beside them) exactly as a
# new user and CI do, and put back what was moved.
#
#   make cold-test          (root; 30-45 minutes on 2 cores)
#
# What it takes away:
# - the Debian packages that tests/cluster/packages.sh installs, and the dependencies that only
#   they needed (those `apt-get autoremove` would remove after the purge and not before). Kept:
#   NEW_MACHINE_HAS below, which every machine of this kind has before any setup (the Python
#   toolchain needs gcc, libc6-dev and make, the machine's network iproute2; purging them would
#   break far more than this project);
# - ~/.cache/multiworld (or $MULTIWORLD_CACHE) and pip's cache, moved aside;
# - .venv: the clones have none.
# `make demo` runs as the unprivileged user `nobody` with a HOME of its own: no root, no apt, no
# cluster, no cache. The clones are of HEAD: uncommitted changes are not in them.
# Afterwards the caches are put back (replacing what the run built), and any purged package the
# run did not reinstall is installed again. Logs and a summary stay in .cold-test/.
set -euo pipefail

NEW_MACHINE_HAS=(make gcc libc6-dev dpkg-dev openssl jq zstd iproute2)

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(git -C "$HERE" rev-parse --show-toplevel)"
SHARED="$(cd "$REPO/.." && pwd)/shared"
CACHE_HOME="${XDG_CACHE_HOME:-$HOME/.cache}"
PROJECT_CACHE="${MULTIWORLD_CACHE:-$CACHE_HOME/multiworld}"
PIP_CACHE="$CACHE_HOME/pip"
LOGS="$REPO/.cold-test"

say() { echo "cold-test: $*" >&2; }
die() { say "$*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (it purges Debian packages); run it as root"
[ -d "$SHARED" ] || die "no $SHARED beside the repository (CI has one; the suite reads it)"
if [ -e /run/multiworld-node.json ] && pgrep -x kubelet >/dev/null; then
  die "a test node runs on this machine; stop it first (make cluster-down)"
fi
HEAD_COMMIT="$(git -C "$REPO" rev-parse --short HEAD)"
if [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
  say "the working tree has uncommitted changes: the clones hold HEAD ($HEAD_COMMIT) without them"
fi

mkdir -p "$LOGS"
WORK="$(mktemp -d /tmp/multiworld-cold.XXXXXX)"
chmod 755 "$WORK"
ASIDE="$WORK/aside"
mkdir -p "$ASIDE"
PURGED=()

# shellcheck disable=SC2329  # runs on EXIT
restore() {
  local status=$? name
  for name in multiworld pip; do
    local kept="$ASIDE/$name" target
    target="$([ "$name" = pip ] && echo "$PIP_CACHE" || echo "$PROJECT_CACHE")"
    if [ -e "$kept" ]; then
      say "putting back $target"
      rm -rf "$target"
      mv "$kept" "$target"
    fi
  done
  if [ ${#PURGED[@]} -gt 0 ]; then
    bash "$HERE/packages.sh" || say "reinstalling the purged packages failed: bash $HERE/packages.sh"
  fi
  rm -rf "$WORK"
  exit "$status"
}
trap restore EXIT
# A signal ends the script through its EXIT trap too (bash skips that trap for an untrapped signal).
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

removable() {  # what `apt-get autoremove` would remove now
  apt-get -s autoremove 2>/dev/null | awk '$1 == "Remv" {print $2}' | sort
}

# ---- take away what a new machine lacks ---------------------------------------------------------
to_purge=()
while read -r package; do
  keep=0
  for kept in "${NEW_MACHINE_HAS[@]}"; do [ "$package" = "$kept" ] && keep=1; done
  status="$(dpkg-query -W -f='${db:Status-Abbrev}' "$package" 2>/dev/null || true)"
  if [ "$keep" -eq 0 ] && [ "${status:0:1}" = i ]; then to_purge+=("$package"); fi
done < <(bash "$HERE/packages.sh" list)
before="$(removable)"
if [ ${#to_purge[@]} -gt 0 ]; then
  say "purging ${to_purge[*]}"
  PURGED=("${to_purge[@]}")
  DEBIAN_FRONTEND=noninteractive apt-get purge -y -q "${to_purge[@]}" >"$LOGS/purge.log" 2>&1
  orphans="$(comm -13 <(echo "$before") <(removable))"
  if [ -n "$orphans" ]; then
    say "purging what only they needed: $(echo "$orphans" | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one package a word
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -q $orphans >>"$LOGS/purge.log" 2>&1
  fi
else
  say "none of the setup's packages is installed: nothing to purge"
fi
for name in multiworld pip; do
  source_dir="$([ "$name" = pip ] && echo "$PIP_CACHE" || echo "$PROJECT_CACHE")"
  if [ -e "$source_dir" ]; then
    say "moving $source_dir aside"
    mv "$source_dir" "$ASIDE/$name"
  fi
done

clone() {  # a fresh clone of HEAD in $1/main, ../shared beside it
  mkdir -p "$1"
  git clone -q --no-local "$REPO" "$1/main"
  git -C "$1/main" reset -q --hard "$HEAD_COMMIT"  # HEAD as it was when the check began
  ln -s "$SHARED" "$1/shared"
}

# ---- make demo: no root, no apt, no cluster, no cache ------------------------------------------
clone "$WORK/demo"
mkdir -p "$WORK/demo/home"
chown -R nobody:nogroup "$WORK/demo"
say "make demo as nobody in a fresh clone (log: $LOGS/demo.log)"
demo_started=$SECONDS
demo_status=0
# Its PATH holds no folder under /root (closed to others): the machine's Debian python3 runs it.
(cd "$WORK/demo/main" && env HOME="$WORK/demo/home" XDG_CACHE_HOME="$WORK/demo/home/.cache" \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  setpriv --reuid=nobody --regid=nogroup --clear-groups env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL make demo) >"$LOGS/demo.log" 2>&1 || demo_status=$?
demo_s=$((SECONDS - demo_started))
say "make demo: exit $demo_status in $demo_s s"
rm -rf "$WORK/demo"

# ---- .ci/run, as CI runs it ----------------------------------------------------------------------
clone "$WORK/ci"
say ".ci/run in a fresh clone (log: $LOGS/ci.log; 30-45 minutes)"
ci_started=$SECONDS
ci_status=0
# Not under this make: CI starts .ci/run from no make at all.
(cd "$WORK/ci/main" && env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL bash .ci/run) 2>&1 | tee "$LOGS/ci.log" || ci_status=${PIPESTATUS[0]}
ci_s=$((SECONDS - ci_started))

{
  echo "cold-test of $HEAD_COMMIT on $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores"
  echo "purged: ${PURGED[*]:-(nothing)}"
  echo "make demo (as nobody, cold venv): exit $demo_status, $demo_s s"
  grep -E '^ +world[0-9]+:|^ +orphan' "$LOGS/demo.log" || true
  echo ".ci/run: exit $ci_status, $ci_s s; by step:"
  grep -E '^\[[a-z-]+ took [0-9]+ s\]$' "$LOGS/ci.log" || true
  grep -E '^[0-9]+ (passed|failed)|(passed|failed).* in [0-9.]+s' "$LOGS/ci.log" | tail -n 1 || true
} | tee "$LOGS/summary.txt"
[ "$demo_status" -eq 0 ] && [ "$ci_status" -eq 0 ]
