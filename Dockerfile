# The bridge image the Helm chart runs (image.repository). Build from the repository root:
#   docker build -t <registry>/cube-csi-bridge:0.1.0 .
# One static-enough binary on a slim Debian base: the bridge mounts through syscalls and
# needs no userland tools of its own (the CSI driver's container brings mount helpers).
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin cube-csi-bridge

FROM debian:bookworm-slim
COPY --from=build /src/target/release/cube-csi-bridge /usr/local/bin/cube-csi-bridge
ENTRYPOINT ["/usr/local/bin/cube-csi-bridge"]
CMD ["--help"]
