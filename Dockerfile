# Stoker's two images from one file: `--target operator` (`stoker-operator`: controller,
# dispatcher and policies) and `--target worker` (`stoker-worker`: runs a DataPipeline's
# transforms and streams batches). Build from the repository root with BuildKit:
#   docker build --target operator -t ghcr.io/stoker-dev/stoker-operator:0.1.0 .
#   docker build --target worker   -t ghcr.io/stoker-dev/stoker-worker:0.1.0 .
#
# Two build arguments let a machine without a registry build them (the e2e tests do):
# BINARIES=prebuilt copies `target/release/stoker-{operator,worker}` built on the host instead
# of compiling in the `rust` image, and BASE names the runtime base (glibc, libgcc, CA
# certificates, a nonroot user 65532; see e2e/cluster/base-image.sh for one made locally).
# The `stoker` CLI (crate stoker-local) is a user tool and stays out of both.

ARG BASE=gcr.io/distroless/cc-debian12:nonroot
ARG BINARIES=compiled

FROM rust:1.95-bookworm AS compiled
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
