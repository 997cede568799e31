# Entry points; CI runs `make test` through .ci/run.
CARGO ?= cargo
PYTHON ?= python3
CACHE := $(or $(STOKER_CACHE),$(HOME)/.cache/stoker)
VENV := $(CACHE)/venv
export PATH := $(CACHE)/bin:$(PATH)

.PHONY: demo test tools generate lint python venv deps

# Runs the local demo: no cluster needed. Release build: the workers really decode JPEGs.
demo: deps
	$(CARGO) build --release -q -p stoker-local -p stoker-worker --bins
	target/release/stoker demo

# Every test tier that can run on this machine: formatting and lints first, then unit, chart,
# and e2e on a real control plane; then the e2e scenarios again on real pods (a kubelet on
# Docker, images built here), and on kind where docker and kind exist (otherwise it says why it
# is skipped). The worker's benchmarks (its `bench` feature) are built so their tests run too.
test: deps lint tools venv
	$(CARGO) build --workspace --bins --features stoker-worker/bench
	STOKER_PYTHON=$(VENV)/bin/python $(CARGO) test --workspace --no-fail-fast --features stoker-worker/bench
	$(MAKE) python
	STOKER_E2E_PROVIDER=kubelet $(CARGO) test -p stoker-e2e --test e2e
	STOKER_E2E_PROVIDER=kind $(CARGO) test -p stoker-e2e --test e2e

# The Python client's tests (against the workers `cargo build` made), in a venv kept in the
# cache; the package is reinstalled each run so edits are picked up. PyTorch (with its CUDA
# wheels from PyPI, about 5 GB installed; a minute here the first time) is installed too, so
# the PyTorch adaptor's tests run rather than skip.
python: venv
	STOKER_PYTHON=$(VENV)/bin/python $(VENV)/bin/python -m pytest -q -rs client/python/tests

# The venv the Python tests and the workers' `python` transforms run in (STOKER_PYTHON).
venv:
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check './client/python[torch]' pytest tokenizers

# etcd, kube-apiserver, kube-controller-manager, kubectl, helm into ~/.cache/stoker/bin.
tools:
	bash e2e/cluster/install-tools.sh

# Regenerates everything derived from the code: the CRD (crds/ and the chart's copy) and the
# rendered install bundle. Tests fail when these are stale.
generate: tools
	$(CARGO) run -q -p stoker-operator --bin stoker-operator -- crd > crds/datapipelines.stoker.dev.yaml
	cp crds/datapipelines.stoker.dev.yaml charts/stoker/files/crds/datapipelines.stoker.dev.yaml
	helm template stoker charts/stoker --namespace stoker-system > manifests/install.yaml

# rustfmt.toml holds the style; clippy's warnings are errors.
lint: deps
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy --workspace --all-targets --features stoker-worker/bench -- -D warnings

# The C library the worker links statically: libjpeg-turbo's headers and static library, from
# Debian (already on this project's machines; installed when missing).
deps:
	@dpkg -s libjpeg62-turbo-dev >/dev/null 2>&1 || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends libjpeg62-turbo-dev >/dev/null; }
