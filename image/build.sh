#!/usr/bin/env bash
# `make image`: an OCI image index for linux/amd64 and linux/arm64, each image laid out as
# upstream's calico/cni v3.32.1 is, FROM scratch, built offline with Debian's buildah:
#   /opt/cni/bin/calico                  our static (musl) binary
#   /opt/cni/bin/calico-ipam -> calico   the same binary, by argv[0]
#   /opt/cni/bin/install     -> calico
#   /opt/cni/bin/{host-local,portmap,loopback,tuning}   the reference plugins, static, from
#                                        the pinned containernetworking/plugins module
#                                        (tools/peers/build.sh: peers cni-plugins and
#                                        cni-plugins-arm64)
#   /licenses/                           ours and the reference plugins'
# with upstream's CMD /opt/cni/bin/install, WORKDIR /opt/cni/bin and /opt/cni/bin first on PATH.
#
#   image/build.sh CALICO_AMD64 CALICO_ARM64 OUT_DIR
#     -> OUT_DIR/calico-cni-rs.oci.tar (an oci-archive holding the index and both images, which
#        `podman load` and `ctr images import` take; each loads its own platform's image). Its
#        one reference is calico/cni:<the release it replaces>; `skopeo copy --all
#        --preserve-digests oci-archive:OUT_DIR/calico-cni-rs.oci.tar docker://REG/calico/cni:v3.32.1`
#        pushes the index and both images with the index's digest kept (docs/swap-in.md).
#     -> OUT_DIR/rootfs/{amd64,arm64}  what each image holds, as a directory
set -euo pipefail

usage="usage: $0 CALICO_AMD64 CALICO_ARM64 OUT_DIR"
declare -A calico=(
  [amd64]=$(realpath "${1:?$usage}")
  [arm64]=$(realpath "${2:?$usage}")
)
out=$(realpath -m "${3:?$usage}")
src=$(cd "$(dirname "$0")/.." && pwd)
# The reference plugins, as tools/peers/build.sh links them: bin for amd64, bin-arm64.
peers=${CALICO_PEERS_CACHE:-/var/cache/calico-cni-rs/peers}
declare -A plugins_dir=([amd64]="$peers/bin" [arm64]="$peers/bin-arm64")
# What `file` calls each architecture.
declare -A machine=([amd64]="x86-64" [arm64]="ARM aarch64")
plugins=(host-local portmap loopback tuning)
arches=(amd64 arm64)
# `calico -v`: the release it replaces with ours as build metadata, v3.32.1+calico-cni-rs.0.1.0
# (src/lib.rs), the image's version label.
version=$("${calico[amd64]}" -v)
upstream=${version%%+*}
if [[ $version != "$upstream+calico-cni-rs."* ]]; then
  echo "${calico[amd64]} -v says $version, not <release it replaces>+calico-cni-rs.<ours>" >&2
  exit 1
fi
# The archive's reference: the image it stands in for, calico/cni:v3.32.1, the name a registry
# mirror serves it under (the Tigera operator asks for <registry>/<imagePath>/cni:v3.32.1).
name="calico/cni:${upstream}"

# Every binary the image copies onto a node must be static, and of the image's architecture.
check_binary() {
  local path=$1 arch=$2 what
  what=$(file -L "$path")
  if ! grep -q "statically linked\|static-pie linked" <<<"$what"; then
    echo "$path is not statically linked: $what" >&2
    exit 1
  fi
  if ! grep -q "${machine[$arch]}" <<<"$what"; then
    echo "$path is not a ${machine[$arch]} ($arch) executable: $what" >&2
    exit 1
  fi
}

rm -rf "$out/rootfs" "$out/plugins"
for arch in "${arches[@]}"; do
  check_binary "${calico[$arch]}" "$arch"
  for p in "${plugins[@]}"; do
    [ -e "${plugins_dir[$arch]}/$p" ] || {
      echo "${plugins_dir[$arch]}/$p is missing: \`make deps\` builds it (tools/peers/build.sh)" >&2
      exit 1
    }
    check_binary "${plugins_dir[$arch]}/$p" "$arch"
  done
  root="$out/rootfs/$arch"
  mkdir -p "$root/opt/cni/bin" "$root/licenses"
  install -m 0755 "${calico[$arch]}" "$root/opt/cni/bin/calico"
  ln -s calico "$root/opt/cni/bin/calico-ipam"
  ln -s calico "$root/opt/cni/bin/install"
  for p in "${plugins[@]}"; do
    install -m 0755 "${plugins_dir[$arch]}/$p" "$root/opt/cni/bin/$p"
  done
  install -m 0644 "$src/LICENSE" "$root/licenses/LICENSE"
  # The module's LICENSE, kept by the peers' build beside the plugins it built.
  install -m 0644 "$(dirname "$(readlink -f "${plugins_dir[$arch]}/host-local")")/LICENSE" \
    "$root/licenses/LICENSE.containernetworking-plugins"
done

# buildah with its own storage under OUT_DIR (the machine's image store is left alone), made
# afresh each time: only this build's images are in it.
storage=(--root "$out/storage" --runroot "$out/run" --storage-driver vfs)
rm -rf "$out/storage" "$out/run"
containers=()
cleanup() {
  for c in "${containers[@]}"; do buildah "${storage[@]}" rm "$c" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
list="localhost/$name"
buildah "${storage[@]}" manifest create "$list" >/dev/null
for arch in "${arches[@]}"; do
  ctr=$(buildah "${storage[@]}" from --arch "$arch" --os linux scratch)
  containers+=("$ctr")
  buildah "${storage[@]}" copy "$ctr" "$out/rootfs/$arch/" / >/dev/null
  buildah "${storage[@]}" config \
    --arch "$arch" --os linux \
    --env PATH=/opt/cni/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --workingdir /opt/cni/bin \
    --cmd /opt/cni/bin/install \
    --label org.opencontainers.image.title="Calico Networking for CNI (calico-cni-rs)" \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.licenses=Apache-2.0 \
    "$ctr"
  buildah "${storage[@]}" commit --quiet --format oci "$ctr" "localhost/$name-$arch" >/dev/null
  buildah "${storage[@]}" manifest add --arch "$arch" --os linux "$list" \
    "containers-storage:localhost/$name-$arch" >/dev/null
done
rm -f "$out/calico-cni-rs.oci.tar"
buildah "${storage[@]}" manifest push --quiet --all --format oci "$list" \
  "oci-archive:$out/calico-cni-rs.oci.tar:$name" >/dev/null
size=$(stat -c %s "$out/calico-cni-rs.oci.tar")
echo "image $name, version $version (linux/amd64, linux/arm64): $out/calico-cni-rs.oci.tar ($((size / 1024 / 1024)) MiB, $size bytes)"
echo "push it: skopeo copy --all --preserve-digests oci-archive:$out/calico-cni-rs.oci.tar docker://<registry>/$name"
