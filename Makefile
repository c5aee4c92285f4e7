# `make demo` and `make test` set everything up themselves (idempotent) in .venv/.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: demo test bench cluster cluster-down operator kube-binaries images crd clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (torch pinned by constraints.txt)"
	@$(PY) -m pip install $(PIP_QUIET) -c constraints.txt -e '.[worker,operator,dev]' 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import torch, kopf, multiworld, multiworld_operator" && touch $@

demo: $(STAMP)
	$(VENV)/bin/multiworld run examples/all_gather/multiworld.yaml --spares w1=2 --kill w1:1 --after 8 --duration 30

# pytest exit code 5 means "no tests collected": not a failure of the build. The images are built
# here, before pytest, so that no test waits minutes for them.
test: $(STAMP) kube-binaries images
	@$(PY) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

bench: $(STAMP)
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

crd: $(STAMP)
	$(VENV)/bin/multiworld crd > crds/multiworld.io_multiworlds.yaml
	cp crds/multiworld.io_multiworlds.yaml charts/multiworld-operator/crds/

clean:
	rm -rf $(VENV) .cluster .pytest_cache

# The test cluster's binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubelet, kube-proxy, kubectl) and the node's Debian packages: built or installed once, cached
# in ~/.cache/multiworld/ (9-15 minutes on 2 cores when cold; needs root for apt).
kube-binaries:
	@$(PYTHON) tests/cluster/cluster.py binaries >/dev/null

# The operator and worker images (multiworld/{operator,worker}:dev), built from the Dockerfile with
# a private dockerd and cached in ~/.cache/multiworld/images/ (root; a few minutes when cold),
# then loaded into the running `make cluster` node's containerd, if there is one.
IMAGES_CONTAINERD := .cluster/node/containerd/containerd.sock
images: kube-binaries
	@$(PYTHON) tests/cluster/images.py build >/dev/null
	@if [ -S $(IMAGES_CONTAINERD) ]; then $(PYTHON) tests/cluster/images.py load --address $(IMAGES_CONTAINERD); \
	else echo "images built and cached; \`make cluster\` loads them into its node"; fi

# A local cluster in .cluster/ for trying it: eval "$$(make -s cluster)". One real node (kubelet,
# containerd, pod network, cluster DNS) with our images loaded; NODES=0: the control plane alone.
NODES ?= 1
cluster: kube-binaries
	@$(PYTHON) tests/cluster/cluster.py up --nodes $(NODES)
	@if [ "$(NODES)" != 0 ]; then $(PYTHON) tests/cluster/images.py load --address $(IMAGES_CONTAINERD) >&2; fi

cluster-down:
	@$(PYTHON) tests/cluster/cluster.py down

# The chart with real Helm (helm-python-sdk) into the `make cluster` node: the operator image as
# its Deployment, workers' ServiceAccount in `default`. Then: kubectl apply -f examples/...
operator: $(STAMP)
	@$(PY) tests/cluster/operator_release.py --kubeconfig .cluster/kubeconfig
