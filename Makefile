# Entry points; CI runs `make test` through .ci/run.
CARGO ?= cargo
PYTHON ?= python3
CACHE := $(or $(STOKER_CACHE),$(HOME)/.cache/stoker)
VENV := $(CACHE)/venv
export PATH := $(CACHE)/bin:$(PATH)

.PHONY: demo test test-lint test-rust test-python test-kubelet test-kind tools generate lint lint-venv python venv deps

# Runs the local demo: no cluster needed. It builds exactly what `make test` builds first (the
# worker's own code optimised even there, so its workers really decode and crop at the rate the
# demo asks of them), so neither command rebuilds what the other built. Cargo prints each crate
# as it compiles.
demo: deps
	@echo "==> make demo: building Stoker (from nothing about 6.5 min on 2 cores, then seconds)"
	$(CARGO) build $(WORKSPACE_BUILD)
	@echo "==> make demo: running it"
	target/debug/stoker demo

# The one build of the binaries, shared by `make demo` and the Rust tier: every binary, with
# the worker's benchmarks (its `bench` feature) so their tests run too.
WORKSPACE_BUILD := --workspace --bins --features stoker-worker/bench

# Every test tier that can run on this machine, in order, each run even when one before it
# failed (one failure must not hide the others); exits non-zero at the end if any failed, and
# prints each tier's time. Formatting and lints; unit, chart and e2e on a real control plane;
# the Python client; the e2e scenarios again on real pods (a kubelet on Docker, images built
# here), and on kind where docker and kind exist (otherwise it says why it is skipped).
TIERS := lint rust python kubelet kind

# A run from a fresh clone gains nothing from incremental compilation, whose files were 4.2 GB
# of the 9.9 GB target/ such a run left; CI's disk is shared and once ran out mid-build.
# Each tier's line in the summary says how much disk was free after it.
test: export CARGO_INCREMENTAL ?= 0
test: deps
	@failed=; summary=; start=$$(date +%s); \
	echo "==> make test: $$(df -h --output=avail . | tail -1 | tr -d ' ') free on the disk of $$(pwd)"; \
	for tier in $(TIERS); do \
	  echo "==> make test: tier $$tier"; t0=$$(date +%s); \
	  if $(MAKE) --no-print-directory test-$$tier; then result=passed; else result=FAILED; failed="$$failed $$tier"; fi; \
	  summary="$$summary  $$tier: $$result in $$(( $$(date +%s) - t0 )) s ($$(df -h --output=avail . | tail -1 | tr -d ' ') free after)\n"; \
	done; \
	printf "==> make test: every tier ran in %s s\n$$summary" $$(( $$(date +%s) - start )); \
	if [ -n "$$failed" ]; then echo "==> make test: FAILED:$$failed"; exit 1; fi

test-lint: lint

# Tests that mostly wait run beside the others, their output kept and printed after the
# others': the e2e scenarios on the local provider (a real control plane, the operator and
# workers as processes; they wait on the API server: 298 s for 94 CPU-seconds) and the local
# tests marked `test = false` in local/Cargo.toml (timeouts, rate limits, processes starting:
# 215 s for 55), where the other tests take 476 s for 468 (each binary alone). Both runs are
# built first. (A `test = false` target is left out of a plain `cargo test --workspace`: each
# tier names them.)
WAITING = $(E2E) $(shell awk '/^\[/ { test = ($$0 == "[[test]]"); name = "" } test && /^name *=/ { gsub(/"/, "", $$3); name = $$3 } test && /^test *= *false/ { print "--test " name }' local/Cargo.toml)
test-rust: deps tools venv
	$(CARGO) build $(WORKSPACE_BUILD)
	$(CARGO) test $(WAITING) --no-run
	$(CARGO) test --workspace --features stoker-worker/bench --no-run
	@log=$${CARGO_TARGET_DIR:-target}/waiting-tests.log; \
	echo "==> make test-rust: the tests that mostly wait run beside the others, into $$log"; \
	STOKER_PYTHON=$(VENV)/bin/python $(CARGO) test --no-fail-fast $(WAITING) >$$log 2>&1 & waiting=$$!; \
	STOKER_PYTHON=$(VENV)/bin/python $(CARGO) test --workspace --no-fail-fast --features stoker-worker/bench; others=$$?; \
	wait $$waiting; waiting=$$?; \
	echo "==> make test-rust: the tests that mostly wait (they ran beside the tests above):"; \
	cat $$log; \
	[ $$others = 0 ] && [ $$waiting = 0 ]

test-python: python

# The real-pod tiers' images carry the binaries the rust tier built and tested (see
# e2e/cluster/images.sh), not a second, release build of everything. Their e2e binary is the
# rust tier's too: selected from the workspace with the same features (`-p stoker-e2e` alone
# resolves dependencies' features differently, and rebuilt 15 crates: 91 s in a CI run).
E2E := --workspace --features stoker-worker/bench --test e2e
test-kubelet: deps tools venv
	STOKER_IMAGE_PROFILE=dev STOKER_E2E_PROVIDER=kubelet $(CARGO) test $(E2E)

test-kind: deps tools
	STOKER_IMAGE_PROFILE=dev STOKER_E2E_PROVIDER=kind $(CARGO) test $(E2E)

# The Python client's tests (against the workers `cargo build` made), in a venv kept in the
# cache; the package is reinstalled each run so edits are picked up. PyTorch (with its CUDA
# wheels from PyPI, about 5 GB installed; a minute here the first time) is installed too, so
# the PyTorch adaptor's tests run rather than skip.
python: venv
	STOKER_PYTHON=$(VENV)/bin/python $(VENV)/bin/python -m pytest -q -rs client/python/tests

# The venv the Python tests and the workers' `python` transforms run in (STOKER_PYTHON). The
# client package is the Rust client bound to Python (client/python/src), built by maturin
# (fetched from PyPI by pip) with cargo into target/: here in the dev profile, which reuses
# what the rust tier built, where `pip install ./client/python` alone builds it optimised.
# pyarrow writes the Parquet files the worker's reader is tested on (worker/tests/parquet.rs).
venv:
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	MATURIN_PEP517_ARGS="--profile dev" $(VENV)/bin/pip install -q --disable-pip-version-check \
	  './client/python[torch]' pytest tokenizers pyarrow xxhash

# etcd, kube-apiserver, kube-controller-manager, kubectl, helm into ~/.cache/stoker/bin.
tools:
	bash e2e/cluster/install-tools.sh

# Regenerates everything derived from the code: the CRD (crds/ and the chart's copy) and the
# rendered install bundle. Tests fail when these are stale.
generate: tools
	$(CARGO) run -q -p stoker-operator --bin stoker-operator -- crd > crds/datapipelines.stoker.dev.yaml
	cp crds/datapipelines.stoker.dev.yaml charts/stoker/files/crds/datapipelines.stoker.dev.yaml
	helm template stoker charts/stoker --namespace stoker-system > manifests/install.yaml

# rustfmt.toml holds the Rust style, ruff.toml and mypy.ini the Python checks; every warning
# is an error.
lint: deps lint-venv
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --features stoker-worker/bench -- -D warnings
	# Again without the worker's `bench` feature (what it leaves out is in the worker): the
	# whole workspace, so that the dependencies keep their features and are not checked again
	# (`-p stoker-worker` alone: 49 s, this: 16 s).
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(LINT_VENV)/bin/ruff format --check .
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/mypy

# Ruff (ruff.toml) and mypy (mypy.ini) for the Python, pinned, in a small venv of their own.
LINT_VENV := $(CACHE)/lint-venv
lint-venv:
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q --disable-pip-version-check 'ruff==0.17.6' 'mypy==2.4.1' 'numpy>=2,<3'

# The C library the worker links statically: libjpeg-turbo's headers and static library, from
# Debian (already on this project's machines; installed when missing).
deps:
	@dpkg -s libjpeg62-turbo-dev >/dev/null 2>&1 || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends libjpeg62-turbo-dev >/dev/null; }
