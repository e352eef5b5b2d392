# The bridge image the Helm chart runs (image.repository). Build from the repository root:
#   docker build -t <registry>/cube-csi-bridge:0.1.0 .
# The bridge (and its forked hook's front) on a slim Debian base: the bridge needs no userland tools of its own (it never
# mounts; the CSI driver's container brings the mount helpers).
#
# Both base images are pinned by digest (the multi-platform index digest), as recorded by the
# Docker official images' repo-info records: repos/rust/remote/1.95.0-bookworm.md (build of
# May 2026) and repos/debian/remote/bookworm-20260918-slim.md. They were taken from those
# records, not from a pull (the machine this was written on has no container daemon); a
# build that cannot resolve a digest fails rather than use something else. To move to newer
# bases, pass both with their digests:
#   docker build --build-arg RUST_IMAGE=rust:<version>-bookworm@sha256:<digest> \
#                --build-arg RUNTIME_IMAGE=debian:bookworm-<date>-slim@sha256:<digest> .
# Keep both on the same Debian release: the binary links the builder's glibc.
ARG RUST_IMAGE=rust:1.95.0-bookworm@sha256:adad87df11151c18ba1689c3e1ea8d4810540a29c0adf4a3d69aec35d8ed8968
ARG RUNTIME_IMAGE=debian:bookworm-20260918-slim@sha256:3783cc01769c7b2b1b83a5c5ad96c815348e28ed7da68e2e3687004faa906251

FROM ${RUST_IMAGE} AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin cube-csi-bridge --bin cube-csi-hook

FROM ${RUNTIME_IMAGE}
COPY --from=build /src/target/release/cube-csi-bridge /usr/local/bin/cube-csi-bridge
# The forked hook's front, for hosts that copy the binaries out of the image (README).
COPY --from=build /src/target/release/cube-csi-hook /usr/local/bin/cube-csi-hook
# A fixed, numeric, unprivileged user, so that a container nobody configured runs without
# root. The Helm chart runs the bridge containers as uid 0 with no capabilities beyond what
# each needs: the host directories they write (sockets, state, volume base dir) are
# root-owned, and Kubernetes gives a non-root container no capabilities.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/cube-csi-bridge"]
CMD ["--help"]
