#!/usr/bin/env bash
# Builds the programs the tests run beside ours (Kubernetes, containerd, cri-tools, the CNI
# reference plugins, etcd) from the Go module proxy, at the versions pinned by the go.mod and
# go.sum of each folder here. `make deps` runs it.
#
# Each peer builds into $CALICO_PEERS_CACHE (default /var/cache/calico-cni-rs/peers), in a
# folder keyed by its version and by the hash of its go.mod, go.sum, this script and the Go
# version; a folder that is complete is never built again, so a second run is a no-op. The
# current build of every program is linked from $CALICO_PEERS_CACHE/bin, where the tests look
# (tests/common/peers.rs; CALICO_PEERS_BIN overrides).
#
# Static (CGO off) and stamped with its version as its own build stamps it (ldflags), so that
# `kube-apiserver --version` says v1.35.x and `containerd --version` v2.x.
#
# A peer named <folder>-arm64 (cni-plugins-arm64: the plugins of the image's arm64 manifest)
# is <folder>'s peer built with GOARCH=arm64, in a cache folder of its own, linked from
# $CALICO_PEERS_CACHE/bin-arm64 instead of bin.
#
# Usage: tools/peers/build.sh [peer...]   (default: every peer)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${CALICO_PEERS_CACHE:-/var/cache/calico-cni-rs/peers}
export GOFLAGS="-mod=readonly -trimpath -buildvcs=false"
export CGO_ENABLED=0
# The peers need Go 1.25 or newer; Debian's golang-go (1.19, /usr/bin/go, which the libcni
# tests use) may come first on PATH, so take the machine's own Go where it is newer.
for candidate in go /usr/local/go/bin/go; do
    v=$("$candidate" env GOVERSION 2>/dev/null || true)
    if [ "$(printf '%s\n' go1.25 "$v" | sort -V | head -n1)" = go1.25 ] && [ -n "$v" ]; then
        go_bin=$(command -v "$candidate")
        go() { "$go_bin" "$@"; }
        break
    fi
done
go_version=$(go env GOVERSION)
case $go_version in go1.2[5-9]* | go1.[3-9]*) ;; *)
    echo "tools/peers needs Go 1.25 or newer (found ${go_version:-none})" >&2; exit 1 ;;
esac

# The version a peer's go.mod requires of a module, and that version's commit (the proxy's
# record of where it came from; empty when the proxy has none).
mod_version() { go -C "$here/$1" list -m -f '{{.Version}}' "$2"; }
mod_commit() {
    go -C "$here/$1" list -m -json "$2@$(mod_version "$1" "$2")" 2>/dev/null |
        sed -n 's/^[[:space:]]*"Hash": "\([0-9a-f]*\)".*/\1/p' | head -n1
}
mod_time() { go -C "$here/$1" list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' "$2"; }

# kube-apiserver and kubelet, stamped as hack/lib/version.sh stamps a release.
build_kubernetes() {
    local out=$1 v commit major minor ld
    v=$(mod_version kubernetes k8s.io/kubernetes)
    commit=$(mod_commit kubernetes k8s.io/kubernetes)
    major=${v#v}; major=${major%%.*}
    minor=${v#v*.}; minor=${minor%%.*}
    ld="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        ld+=" -X $pkg.gitCommit=$commit -X $pkg.gitTreeState=clean"
        ld+=" -X $pkg.buildDate=$(mod_time kubernetes k8s.io/kubernetes)"
    done
    go -C "$here/kubernetes" build -ldflags "$ld" -o "$out/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubelet
}

# containerd and its runc shim, stamped as containerd's Makefile stamps them (runc is Debian's).
build_containerd() {
    local out=$1 m=github.com/containerd/containerd/v2 v ld
    v=$(mod_version containerd $m)
    ld="-s -w -X $m/version.Version=$v -X $m/version.Revision=$(mod_commit containerd $m)"
    ld+=" -X $m/version.Package=$m"
    go -C "$here/containerd" build -tags "urfave_cli_no_docs osusergo netgo no_btrfs" \
        -ldflags "$ld" -o "$out/" $m/cmd/containerd $m/cmd/ctr
    go -C "$here/containerd" build -tags "urfave_cli_no_docs osusergo netgo no_grpc" \
        -ldflags "$ld" -o "$out/" $m/cmd/containerd-shim-runc-v2
}

# critest (a compiled test binary, as cri-tools builds it) and crictl.
build_cri_tools() {
    local out=$1 m=sigs.k8s.io/cri-tools v ld
    v=$(mod_version cri-tools $m)
    ld="-s -w -X $m/pkg/version.Version=${v#v}"
    go -C "$here/cri-tools" test -c -ldflags "$ld" -o "$out/critest" $m/cmd/critest
    go -C "$here/cri-tools" build -ldflags "$ld" -o "$out/" $m/cmd/crictl
}

# The reference plugins the calico/cni image ships (host-local, portmap, loopback, tuning)
# and bandwidth, a test fixture only; their LICENSE (the module's), which the image ships.
build_cni_plugins() {
    local out=$1 m=github.com/containernetworking/plugins v
    v=$(mod_version cni-plugins $m)
    go -C "$here/cni-plugins" build \
        -ldflags "-s -w -X $m/pkg/utils/buildversion.BuildVersion=$v" -o "$out/" \
        $m/plugins/ipam/host-local $m/plugins/meta/portmap $m/plugins/main/loopback \
        $m/plugins/meta/tuning $m/plugins/meta/bandwidth
    install -m 0644 "$(go -C "$here/cni-plugins" list -m -f '{{.Dir}}' $m)/LICENSE" "$out/LICENSE"
}

peers=(kubernetes containerd cri-tools cni-plugins cni-plugins-arm64)
[ $# -gt 0 ] && peers=("$@")

mkdir -p "$cache/bin"
exec 9>"$cache/.lock"
flock 9
for peer in "${peers[@]}"; do
    folder=$peer bin=$cache/bin
    case $peer in *-arm64) folder=${peer%-arm64} bin=$cache/bin-arm64 ;; esac
    dir="$here/$folder"
    [ -f "$dir/go.mod" ] || { echo "no peer $peer in $here" >&2; exit 1; }
    main_module=$(sed -n 's/^require \([^ ]*\) .*/\1/p' "$dir/go.mod" | head -n1)
    version=$(mod_version "$folder" "$main_module")
    key=$( (cat "$dir/go.mod" "$dir/go.sum" "$0"; echo "$go_version") | sha256sum | cut -c1-12)
    target="$cache/$peer-$version-$key"
    if [ -e "$target/.complete" ]; then
        echo "peer $peer $version: built ($target)"
    else
        echo "peer $peer $version: building into $target"
        start=$(date +%s)
        rm -rf "$target.tmp"
        mkdir -p "$target.tmp"
        if [ "$folder" = "$peer" ]; then
            "build_${peer//-/_}" "$target.tmp"
        else
            GOARCH=arm64 "build_${folder//-/_}" "$target.tmp"
        fi
        echo "$main_module $version ($go_version)" >"$target.tmp/.complete"
        rm -rf "$target"
        mv "$target.tmp" "$target"
        echo "peer $peer $version: built in $(($(date +%s) - start)) s"
    fi
    # Earlier builds of this peer (other pins, or this script before a change) go.
    for old in "$cache/$peer"-v*; do
        [ "$old" = "$target" ] || rm -rf "$old"
    done
    mkdir -p "$bin"
    for f in "$target"/*; do
        if [ -x "$f" ]; then ln -sfn "$f" "$bin/$(basename "$f")"; fi
    done
done
