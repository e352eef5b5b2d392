// Command cubeclient is a Cube-like caller of a Cube volume plugin, for
// cube-csi-bridge's end-to-end tests. It calls a plugin the way Cubelet and
// CubeMaster do (shared/docs/cube-hook-protocol.md §2 and §3):
//
//	cubeclient rpc --target <sock> create --volume-id ID --name NAME
//	cubeclient rpc --target <sock> destroy --volume-id ID
//	cubeclient rpc --target <sock> attach --sandbox-id S --namespace N --volume-id ID \
//	    --ref-count K --volume-base-dir DIR [--private-data P]
//	cubeclient rpc --target <sock> detach --sandbox-id S --namespace N --volume-id ID \
//	    --ref-count K [--metadata JSON]
//	cubeclient binary --path <executable> <same op and flags>
//	cubeclient loop --target <sock> ...     (attach/detach until a stop file; loop.go)
//	cubeclient bench                        (benchmark phases on stdin; bench.go)
//	cubeclient floor-plugin --listen <sock> (a trivial grpc-go plugin; bench.go)
//
// rpc prints {"token","private_data"} / {"host_path","metadata"} / {} on success
// and {"error","code"} (exit 1) on a gRPC error. binary forks the executable with
// Cube's exact argv and judges its output as Cube does; it prints the same
// success shapes, or {"error","exit_code","stdout"} (exit 1) on failure.
// Usage errors exit 2.
//
// Options accepted before the op: --timeout DURATION (Cube itself sets none; the
// default 0 means none), --proto FILE (the Cube proto to load; defaults: env
// CUBE_VOLUMEPLUGIN_PROTO, the copy embedded at build time by
// scripts/install-test-peers.sh, then proto/cube/v1/volumeplugin.proto found
// upwards from the working directory or the executable).
//
// Flag values are taken verbatim, even when they begin with "-" (Cube volume ids
// may); "--flag=value" is accepted too.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func usage(format string, args ...any) int {
	fmt.Fprintf(os.Stderr, "cubeclient: "+format+"\n", args...)
	fmt.Fprintln(os.Stderr, "usage: cubeclient rpc --target SOCK OP [FLAGS] | cubeclient binary --path EXE OP [FLAGS] | cubeclient bench | cubeclient floor-plugin --listen SOCK")
	return 2
}

// printJSON writes v as one compact JSON line on stdout.
func printJSON(v any) {
	enc := json.NewEncoder(os.Stdout)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
}

type globals struct {
	target, path, proto string
	timeout             time.Duration
}

func run(args []string) int {
	if len(args) == 0 {
		return usage("missing mode")
	}
	mode := args[0]
	args = args[1:]
	switch mode {
	case "loop":
		return runLoop(args)
	case "bench":
		return runBench(args)
	case "floor-plugin":
		return runFloorPlugin(args)
	}
	var g globals
	// Mode options come before the op.
	for len(args) > 0 && strings.HasPrefix(args[0], "--") {
		name, val, rest, err := takeFlag(args)
		if err != nil {
			return usage("%v", err)
		}
		args = rest
		switch name {
		case "target":
			g.target = val
		case "path":
			g.path = val
		case "proto":
			g.proto = val
		case "timeout":
			d, err := time.ParseDuration(val)
			if err != nil {
				return usage("bad --timeout %q: %v", val, err)
			}
			g.timeout = d
		default:
			return usage("unknown option --%s for %s", name, mode)
		}
	}
	ctx := context.Background()
	if g.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, g.timeout)
		defer cancel()
	}
	switch mode {
	case "rpc":
		if g.target == "" {
			return usage("rpc needs --target")
		}
		req, code := parseOp(args)
		if req == nil {
			return code
		}
		return runRPC(ctx, g, req)
	case "binary":
		if g.path == "" {
			return usage("binary needs --path")
		}
		req, code := parseOp(args)
		if req == nil {
			return code
		}
		return runBinary(ctx, g, req)
	case "-h", "--help", "help":
		usage("help")
		return 0
	}
	return usage("unknown mode %q", mode)
}

// takeFlag reads "--name value" or "--name=value" from the front of args.
func takeFlag(args []string) (name, val string, rest []string, err error) {
	a := args[0]
	if !strings.HasPrefix(a, "--") || len(a) == 2 {
		return "", "", nil, fmt.Errorf("expected a --flag, got %q", a)
	}
	a = a[2:]
	if i := strings.IndexByte(a, '='); i >= 0 {
		return a[:i], a[i+1:], args[1:], nil
	}
	if len(args) < 2 {
		return "", "", nil, fmt.Errorf("--%s needs a value", a)
	}
	return a, args[1], args[2:], nil
}

// opRequest is one Cube hook call, independent of transport.
type opRequest struct {
	op            string // create, destroy, attach, detach
	volumeID      string
	name          string
	sandboxID     string
	namespace     string
	refCount      int64
	volumeBaseDir string
	privateData   string
	metadata      map[string]string // nil = none given
}

var opFlags = map[string]struct{ required, optional []string }{
	"create":  {required: []string{"volume-id", "name"}},
	"destroy": {required: []string{"volume-id"}},
	"attach":  {required: []string{"sandbox-id", "namespace", "volume-id", "ref-count", "volume-base-dir"}, optional: []string{"private-data"}},
	"detach":  {required: []string{"sandbox-id", "namespace", "volume-id", "ref-count"}, optional: []string{"metadata"}},
}

func parseOp(args []string) (*opRequest, int) {
	if len(args) == 0 {
		return nil, usage("missing op (create, destroy, attach, detach)")
	}
	r := &opRequest{op: args[0]}
	spec, ok := opFlags[r.op]
	if !ok {
		return nil, usage("unknown op %q", r.op)
	}
	allowed := map[string]bool{}
	for _, f := range append(append([]string{}, spec.required...), spec.optional...) {
		allowed[f] = true
	}
	seen := map[string]string{}
	rest := args[1:]
	for len(rest) > 0 {
		name, val, next, err := takeFlag(rest)
		if err != nil {
			return nil, usage("%s: %v", r.op, err)
		}
		if !allowed[name] {
			return nil, usage("%s: unknown flag --%s", r.op, name)
		}
		if _, dup := seen[name]; dup {
			return nil, usage("%s: --%s given twice", r.op, name)
		}
		seen[name] = val
		rest = next
	}
	for _, f := range spec.required {
		if _, ok := seen[f]; !ok {
			return nil, usage("%s: missing --%s", r.op, f)
		}
	}
	r.volumeID = seen["volume-id"]
	r.name = seen["name"]
	r.sandboxID = seen["sandbox-id"]
	r.namespace = seen["namespace"]
	r.volumeBaseDir = seen["volume-base-dir"]
	r.privateData = seen["private-data"]
	if s, ok := seen["ref-count"]; ok {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil, usage("%s: bad --ref-count %q: %v", r.op, s, err)
		}
		r.refCount = n
	}
	if s, ok := seen["metadata"]; ok {
		if err := json.Unmarshal([]byte(s), &r.metadata); err != nil {
			return nil, usage("%s: --metadata must be a JSON object of strings: %v", r.op, err)
		}
	}
	return r, 0
}

// Success shapes, shared by rpc and binary modes.
type createOut struct {
	Token       string `json:"token"`
	PrivateData string `json:"private_data"`
}

type attachOut struct {
	HostPath string            `json:"host_path"`
	Metadata map[string]string `json:"metadata"`
}

type emptyOut struct{}
