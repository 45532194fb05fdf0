// libcni-driver: a tiny CNI runtime for the end-to-end tests, built on libcni, the library
// containerd, CRI-O and podman use to run CNI plugins. Written for calico-cni-rs; built
// offline by tests/common/libcni.rs from Debian's golang-go + golang-github-appc-cni-dev
// (libcni 1.1.2) with GOPATH=/usr/share/gocode GO111MODULE=off.
//
// Usage:
//
//	libcni-driver add|check|del|cached <conflist-file> <container-id> <netns-path>
//	libcni-driver validate <conflist-file>
//
// add/check/del call AddNetworkList/CheckNetworkList/DelNetworkList; cached prints what
// GetNetworkListCachedResult returns (the cached ADD result converted to the conflist's
// version, as CHECK and DEL get it); validate runs ValidateNetworkList (every plugin found
// in CNI_PATH and, asked with VERSION, supporting the conflist's cniVersion) and prints the
// capabilities as a JSON array.
//
// Environment: CNI_PATH (plugin directories), CNI_CACHE_DIR (libcni's result cache; default
// /var/lib/cni), CNI_IFNAME (default eth0), CNI_ARGS ("K=V;K=V"), CAP_ARGS (a JSON object of
// capability arguments, e.g. {"portMappings":[...],"bandwidth":{...}}), and
// LIBCNI_TIMEOUT_SECONDS (default 60): the context deadline of the whole operation, after
// which libcni kills the plugin.
//
// Exit code 0 on success; otherwise 1 with the error on stderr.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
)

func fail(err error) {
	fmt.Fprintln(os.Stderr, err)
	os.Exit(1)
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: libcni-driver add|check|del|cached <conflist> <container-id> <netns>\n"+
		"       libcni-driver validate <conflist>")
	os.Exit(2)
}

// runtimeConf builds the RuntimeConf a runtime would pass: ids, netns, ifname, CNI_ARGS
// pairs and capability arguments.
func runtimeConf(containerID, netns string) (*libcni.RuntimeConf, error) {
	var capArgs map[string]interface{}
	if v := os.Getenv("CAP_ARGS"); v != "" {
		if err := json.Unmarshal([]byte(v), &capArgs); err != nil {
			return nil, fmt.Errorf("CAP_ARGS: %w", err)
		}
	}
	var cniArgs [][2]string
	if v := os.Getenv("CNI_ARGS"); v != "" {
		for _, kv := range strings.Split(v, ";") {
			p := strings.SplitN(kv, "=", 2)
			if len(p) != 2 {
				return nil, fmt.Errorf("invalid CNI_ARGS pair %q", kv)
			}
			cniArgs = append(cniArgs, [2]string{p[0], p[1]})
		}
	}
	ifName, ok := os.LookupEnv("CNI_IFNAME")
	if !ok {
		ifName = "eth0"
	}
	abs, err := filepath.Abs(netns)
	if err != nil {
		return nil, err
	}
	return &libcni.RuntimeConf{
		ContainerID:    containerID,
		NetNS:          abs,
		IfName:         ifName,
		Args:           cniArgs,
		CapabilityArgs: capArgs,
	}, nil
}

func main() {
	if len(os.Args) < 3 {
		usage()
	}
	verb := os.Args[1]
	list, err := libcni.ConfListFromFile(os.Args[2])
	if err != nil {
		fail(err)
	}
	timeout := 60 * time.Second
	if v := os.Getenv("LIBCNI_TIMEOUT_SECONDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			fail(fmt.Errorf("LIBCNI_TIMEOUT_SECONDS: %w", err))
		}
		timeout = time.Duration(n) * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cni := libcni.NewCNIConfigWithCacheDir(filepath.SplitList(os.Getenv("CNI_PATH")), os.Getenv("CNI_CACHE_DIR"), nil)

	if verb == "validate" {
		caps, err := cni.ValidateNetworkList(ctx, list)
		if err != nil {
			fail(err)
		}
		out, err := json.Marshal(caps)
		if err != nil {
			fail(err)
		}
		fmt.Println(string(out))
		return
	}

	if len(os.Args) != 5 {
		usage()
	}
	rt, err := runtimeConf(os.Args[3], os.Args[4])
	if err != nil {
		fail(err)
	}
	switch verb {
	case "add":
		res, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			fail(err)
		}
		if err := res.Print(); err != nil {
			fail(err)
		}
	case "check":
		if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
			fail(err)
		}
	case "del":
		if err := cni.DelNetworkList(ctx, list, rt); err != nil {
			fail(err)
		}
	case "cached":
		res, err := cni.GetNetworkListCachedResult(list, rt)
		if err != nil {
			fail(err)
		}
		if res == nil {
			fail(fmt.Errorf("no cached result for network %q container %q", list.Name, rt.ContainerID))
		}
		if err := res.Print(); err != nil {
			fail(err)
		}
	default:
		usage()
	}
}
