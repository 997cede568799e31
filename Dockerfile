# Stoker's images from one file: `--target operator` (`stoker-operator`: controller,
# dispatcher and policies), `--target worker` (`stoker-worker`: runs a DataPipeline's
# transforms and streams batches) and `--target worker-python` (the worker beside Python 3 and
# numpy, for pipelines with `python` transforms: set it as spec.workers.image). Build from the
# repository root with BuildKit:
#   docker build --target operator      -t ghcr.io/stoker-dev/stoker-operator:0.1.0 .
#   docker build --target worker        -t ghcr.io/stoker-dev/stoker-worker:0.1.0 .
#   docker build --target worker-python -t ghcr.io/stoker-dev/stoker-worker-python:0.1.0 .
#
# Two build arguments let a machine without a registry build them (the e2e tests do):
# BINARIES=prebuilt copies `target/release/stoker-{operator,worker}` built on the host instead
# of compiling in the `rust` image, and BASE names the runtime base (glibc, libgcc, CA
# certificates, a nonroot user 65532; e2e/cluster/images.sh makes one locally). PYTHON_BASE
# names the worker-python target's base: by default the python-upstream stage below; any image
# with `python3` on PATH, numpy, and what your functions import will do (images.sh makes one
# from this machine's Python). The `stoker` CLI (crate stoker-local) is a user tool and stays
# out of all three.

ARG BASE=gcr.io/distroless/cc-debian12:nonroot
ARG BINARIES=compiled
ARG PYTHON_BASE=python-upstream

FROM rust:1.95-bookworm AS compiled
# The worker links libjpeg-turbo statically (worker/build.rs); the rust image ships its
# development files (libjpeg-dev), so the runtime images need no libjpeg.
WORKDIR /src
COPY . .
# The cache mounts keep the registry and build artifacts between builds; the binaries are
# copied out of the target cache in the same step.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p stoker-operator -p stoker-worker \
 && mkdir -p /out \
 && cp target/release/stoker-operator target/release/stoker-worker /out/

FROM scratch AS prebuilt
COPY target/release/stoker-operator target/release/stoker-worker /out/

FROM ${BINARIES} AS binaries

FROM ${BASE} AS operator
LABEL org.opencontainers.image.title="stoker-operator" \
      org.opencontainers.image.description="Stoker operator: reconciles DataPipelines into autoscaled preprocessing workers" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=binaries /out/stoker-operator /usr/local/bin/stoker-operator
USER 65532:65532
EXPOSE 8080 50051
ENTRYPOINT ["/usr/local/bin/stoker-operator"]

FROM ${BASE} AS worker
LABEL org.opencontainers.image.title="stoker-worker" \
      org.opencontainers.image.description="Stoker worker: runs a DataPipeline's preprocessing and streams batches" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=binaries /out/stoker-worker /usr/local/bin/stoker-worker
USER 65532:65532
EXPOSE 50052
ENTRYPOINT ["/usr/local/bin/stoker-worker"]

# Python for `python` transforms: add your functions' own imports to this pip install, or
# build on your own image with PYTHON_BASE. Built only for the worker-python target.
FROM python:3.11-slim-bookworm AS python-upstream
RUN pip install --no-cache-dir numpy

FROM ${PYTHON_BASE} AS worker-python
LABEL org.opencontainers.image.title="stoker-worker-python" \
      org.opencontainers.image.description="Stoker worker with Python 3 and numpy, for pipelines with python transforms" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=binaries /out/stoker-worker /usr/local/bin/stoker-worker
USER 65532:65532
EXPOSE 50052
ENTRYPOINT ["/usr/local/bin/stoker-worker"]
