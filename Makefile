# `make demo` and `make test` set everything up themselves (idempotent) in .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_QUIET := --quiet --disable-pip-version-check
# `started=$$(date +%s) && COMMAND && $(call took,STEP)` says how long STEP took (the cold time
# of `make test` is read off these lines: tests/cluster/cold_test.sh sums them up).
took = echo "[$(1) took $$(( $$(date +%s) - started )) s]" >&2

.PHONY: demo test test-quick check lint typecheck cold-test bench cluster cluster-down operator packages kube-binaries images crd clean

$(STAMP): pyproject.toml constraints.txt
	@echo "installing into $(VENV) (torch pinned by constraints.txt)"
	@started=$$(date +%s) && { test -x $(PY) || $(PYTHON) -m venv $(VENV); } && \
	  { $(PY) -m pip install $(PIP_QUIET) -c constraints.txt -e '.[worker,operator,dev]' 2>&1 | grep -v "is ignored" || true; } && \
	  $(PY) -c "import torch, kopf, multiworld, multiworld_operator" && touch $@ && $(call took,venv)

demo: $(STAMP)
	$(VENV)/bin/multiworld run examples/all_gather/multiworld.yaml --spares w1=1 --kill w1:1 --after 8 --until-recovered --duration 120

# pytest exit code 5 means "no tests collected": not a failure of the build; the 25 slowest
# tests are listed (what a cold run spends its time on). The checks come first (a lint or type
# error fails in seconds, not after the builds). The builds the tests marked `kube` need (the
# test cluster's binaries and our images: minutes on a new machine, nothing once cached) run
# beside the suite, niced, while the tests that need no API server run first; each `kube` test
# waits for them (tests/support/builds.py). Their log follows the suite's output.
BUILDS_LOG := $(abspath $(VENV))/builds.log
test: $(STAMP) check packages
	@rm -f $(BUILDS_LOG) $(BUILDS_LOG).rc; \
	  { nice -n 19 $(MAKE) -s --no-print-directory kube-binaries images >$(BUILDS_LOG) 2>&1; echo $$? >$(BUILDS_LOG).rc; } & \
	  started=$$(date +%s); MULTIWORLD_BUILDS=$(BUILDS_LOG) $(PY) -m pytest -q --durations=25 tests; rc=$$?; \
	  $(call took,suite); wait; cat $(BUILDS_LOG) >&2; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The quick tier: the tests marked `quick` but not `slow` (the planner, the spec, the pure kube
# and local helpers, CLI parsing), under two minutes; `make test` runs them with the rest.
test-quick: $(STAMP)
	@started=$$(date +%s) && $(PY) -m pytest -q -m "quick and not slow" tests && $(call took,test-quick)

# Linters and the type checker, as configured in pyproject.toml (also .pre-commit-config.yaml).
# One mypy run covers worker/, operator/, bench/ and tests/ (see [tool.mypy]): tests/ and bench/
# are packages named from the repository root, so every module of the tree has a name of its own.
CHECKED := worker operator bench tests
LINT := $(VENV)/bin/ruff check $(CHECKED) && $(VENV)/bin/ruff format --check $(CHECKED)
TYPECHECK := $(VENV)/bin/mypy
# No import cycle among the packages' modules, lazy and type-hint imports included, and no import
# that breaks the layer table of docs/architecture.md (its data: tests/support/layers.py).
IMPORTS := $(PY) -m tests.support.import_graph worker/multiworld operator/multiworld_operator
check: $(STAMP)
	@started=$$(date +%s) && $(LINT) && $(TYPECHECK) && $(IMPORTS) && $(call took,check)

# The two halves of `check`, without the venv step (.pre-commit-config.yaml runs `make typecheck`).
lint:
	@$(LINT)

typecheck:
	@$(TYPECHECK)

# Each bench as a module from the repository root (`python -m bench.NAME`), where it finds tests.support.
bench: $(STAMP)
	@for b in $(filter-out bench/__init__.py,$(wildcard bench/*.py)); do m=bench.$$(basename $$b .py); \
	  echo "== $$m"; $(PY) -m $$m || exit 1; done

crd: $(STAMP)
	$(VENV)/bin/multiworld crd > crds/multiworld.io_multiworlds.yaml
	cp crds/multiworld.io_multiworlds.yaml charts/multiworld-operator/crds/

clean:
	rm -rf $(VENV) .cluster .pytest_cache

# The cold path as a new machine takes it: purge what setup installs, move the cache aside, run
# .ci/run and `make demo` in fresh clones (root; 30-45 minutes). See tests/cluster/cold_test.sh.
cold-test:
	@bash tests/cluster/cold_test.sh

# The Debian packages of the node, the image build and the kubernetes build: the one list, in
# tests/cluster/packages.sh, installed when missing (root or sudo; a no-op when all are there).
packages:
	@started=$$(date +%s) && bash tests/cluster/packages.sh && $(call took,packages)

# The test cluster's binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet, kube-proxy, kubectl): built once, cached in ~/.cache/multiworld/ (9-15 minutes on 2
# cores when cold).
kube-binaries: packages
	@started=$$(date +%s) && $(PYTHON) -m tests.cluster.cluster binaries >/dev/null && $(call took,kube-binaries)

# The operator and worker images (multiworld/{operator,worker}:dev), built from the Dockerfile with
# a private dockerd and cached in ~/.cache/multiworld/images/ (root; a few minutes when cold),
# then loaded into the containerd of every node of the running `make cluster`, if there is one.
LOAD_IMAGES = for socket in .cluster/node/containerd/containerd.sock .cluster/node-*/containerd/containerd.sock; do \
	  if [ -S $$socket ]; then \
	  $(PYTHON) -m tests.cluster.images load --address $$socket >&2 || exit 1; loaded=1; fi; done
images: packages kube-binaries
	@started=$$(date +%s) && $(PYTHON) -m tests.cluster.images build >/dev/null && $(call took,images)
	@loaded=0; $(LOAD_IMAGES); \
	if [ $$loaded = 0 ]; then echo "images built and cached; \`make cluster\` loads them into its nodes"; fi

# A local cluster in .cluster/ for trying it: eval "$$(make -s cluster)". NODES real nodes (1 to 3;
# each a kubelet, containerd and kube-proxy in network and mount namespaces of its own, with its
# own address and pod network, routed to the others; cluster DNS) with our images loaded in each;
# NODES=0: the control plane alone. Faults: python3 -m tests.cluster.cluster power-off|partition|heal NODE.
# Each node's device plugin (4 nvidia.com/gpu) runs with the venv's Python (it needs grpcio).
NODES ?= 1
cluster: kube-binaries $(STAMP)
	@$(PYTHON) -m tests.cluster.cluster up --nodes $(NODES)
	@loaded=0; $(LOAD_IMAGES)

cluster-down:
	@$(PYTHON) -m tests.cluster.cluster down

# The chart with real Helm (helm-python-sdk) into the `make cluster` node: the operator image as
# its Deployment, workers' ServiceAccount in `default`. Then: kubectl apply -f examples/...
operator: $(STAMP)
	@$(PY) -m tests.cluster.operator_release --kubeconfig .cluster/kubeconfig
