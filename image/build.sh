#!/usr/bin/env bash
# `make image`: an OCI image laid out as upstream's calico/cni v3.32.1, FROM scratch, built
# offline with Debian's buildah:
#   /opt/cni/bin/calico                  our static (musl) binary
#   /opt/cni/bin/calico-ipam -> calico   the same binary, by argv[0]
#   /opt/cni/bin/install     -> calico
#   /opt/cni/bin/{host-local,portmap,loopback,tuning,bandwidth}   static reference plugins
#   /licenses/                           ours and the reference plugins'
# with upstream's CMD /opt/cni/bin/install, WORKDIR /opt/cni/bin and /opt/cni/bin first on PATH.
#
#   image/build.sh CALICO_BINARY OUT_DIR  -> OUT_DIR/calico-cni-rs.oci.tar (an oci-archive that
#                                            `podman load` and `ctr images import` take)
set -euo pipefail

bin=$(realpath "${1:?usage: $0 CALICO_BINARY OUT_DIR}")
out=$(realpath -m "${2:?usage: $0 CALICO_BINARY OUT_DIR}")
src=$(cd "$(dirname "$0")/.." && pwd)
version=$("$bin" -v)
name="calico-cni-rs:${version}"

# Every binary the image copies onto a node must be static.
if ! file -L "$bin" | grep -q "statically linked\|static-pie linked"; then
  echo "$bin is not statically linked: $(file -L "$bin")" >&2
  exit 1
fi

"$src/image/build-plugins.sh" "$out/plugins"

root="$out/rootfs"
rm -rf "$root"
mkdir -p "$root/opt/cni/bin" "$root/licenses"
install -m 0755 "$bin" "$root/opt/cni/bin/calico"
ln -s calico "$root/opt/cni/bin/calico-ipam"
ln -s calico "$root/opt/cni/bin/install"
for p in host-local portmap loopback tuning bandwidth; do
  install -m 0755 "$out/plugins/$p" "$root/opt/cni/bin/$p"
done
install -m 0644 "$src/LICENSE" "$root/licenses/LICENSE"
install -m 0644 "$out/plugins/LICENSE.containernetworking-plugins" \
  "$root/licenses/LICENSE.containernetworking-plugins"

# buildah with its own storage under OUT_DIR (the machine's image store is left alone).
storage=(--root "$out/storage" --runroot "$out/run" --storage-driver vfs)
ctr=$(buildah "${storage[@]}" from scratch)
cleanup() { buildah "${storage[@]}" rm "$ctr" >/dev/null 2>&1 || true; }
trap cleanup EXIT
buildah "${storage[@]}" copy "$ctr" "$root/" / >/dev/null
buildah "${storage[@]}" config \
  --env PATH=/opt/cni/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --workingdir /opt/cni/bin \
  --cmd /opt/cni/bin/install \
  --label org.opencontainers.image.title="Calico Networking for CNI (calico-cni-rs)" \
  --label org.opencontainers.image.version="$version" \
  --label org.opencontainers.image.licenses=Apache-2.0 \
  "$ctr"
rm -f "$out/calico-cni-rs.oci.tar"
buildah "${storage[@]}" commit --quiet --format oci "$ctr" \
  "oci-archive:$out/calico-cni-rs.oci.tar:$name" >/dev/null
size=$(stat -c %s "$out/calico-cni-rs.oci.tar")
echo "image $name: $out/calico-cni-rs.oci.tar ($((size / 1024 / 1024)) MiB, $size bytes)"
