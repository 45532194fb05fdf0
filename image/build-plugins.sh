#!/usr/bin/env bash
# The reference CNI plugins upstream's calico/cni image ships (host-local, portmap, loopback,
# tuning, bandwidth), built static (CGO_ENABLED=0) from Debian's own source package of
# containernetworking-plugins, so they run on any x86-64 node whatever its libc. Debian's
# binary package links them against glibc 2.36, which older nodes (RHEL 8, Ubuntu 20.04) lack.
#
# Offline except for Debian's registry: the source comes from `apt-get source` through a
# private sources list and lists directory (the machine's apt configuration is untouched),
# the Go dependencies from Debian's golang-*-dev packages (GOPATH mode).
#
#   image/build-plugins.sh OUT_DIR     -> OUT_DIR/{host-local,portmap,loopback,tuning,bandwidth}
#                                         OUT_DIR/LICENSE.containernetworking-plugins
set -euo pipefail

out=$(realpath -m "${1:?usage: $0 OUT_DIR}")
plugins=(ipam/host-local meta/portmap main/loopback meta/tuning meta/bandwidth)
# The Debian packages the build needs: Go and the plugins' Go dependencies.
go_deps=(golang-go golang-github-appc-cni-dev golang-github-alexflint-go-filemutex-dev
  golang-github-coreos-go-iptables-dev golang-github-safchain-ethtool-dev
  golang-github-vishvananda-netlink-dev golang-golang-x-sys-dev
  golang-github-networkplumbing-go-nft-dev golang-github-mattn-go-shellwords-dev)

done_all=1
for p in "${plugins[@]}"; do [ -x "$out/$(basename "$p")" ] || done_all=0; done
if [ "$done_all" = 1 ] && [ -f "$out/LICENSE.containernetworking-plugins" ]; then
  echo "reference plugins already built in $out"
  exit 0
fi

missing=()
for p in "${go_deps[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

work=$(mktemp -d /var/tmp/calico-cni-plugins.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/etc" "$work/lists/partial" "$work/src"
cat > "$work/etc/source.sources" <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
apt_opts=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$work/etc"
  -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq
(cd "$work/src" && apt-get "${apt_opts[@]}" source --download-only -qq containernetworking-plugins)
tar -xf "$work"/src/*.orig.tar.xz -C "$work/src"
tree=$(find "$work/src" -mindepth 1 -maxdepth 1 -type d -name 'plugins-*' | head -n1)
gopath="$work/gopath"
mkdir -p "$gopath/src/github.com/containernetworking"
mv "$tree" "$gopath/src/github.com/containernetworking/plugins"

mkdir -p "$out"
cd "$gopath/src/github.com/containernetworking/plugins"
for p in "${plugins[@]}"; do
  GOPATH="$gopath:/usr/share/gocode" GO111MODULE=off CGO_ENABLED=0 GOCACHE="$work/gocache" \
    go build -trimpath -ldflags "-s -w" -o "$out/$(basename "$p")" "./plugins/$p"
done
cp LICENSE "$out/LICENSE.containernetworking-plugins"
echo "built static ${plugins[*]} into $out"
