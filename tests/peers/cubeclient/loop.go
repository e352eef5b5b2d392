package main

// loop mode: one long-lived connection, dialed as Cubelet dials it, calling Attach and
// Detach over and over until a stop file appears. tests/operations.rs restarts the
// bridge underneath it (systemd socket activation) and expects no call to fail.
//
//	cubeclient loop --target SOCK --volume-id ID --volume-base-dir DIR \
//	    --private-data P --stop-file F
//
// Prints {"calls":N,"failures":["..."]} and exits 0, or 1 when any call failed.

import (
	"context"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

func runLoop(args []string) int {
	seen := map[string]string{}
	for len(args) > 0 {
		name, val, rest, err := takeFlag(args)
		if err != nil {
			return usage("loop: %v", err)
		}
		seen[name] = val
		args = rest
	}
	for _, f := range []string{"target", "volume-id", "volume-base-dir", "private-data", "stop-file"} {
		if seen[f] == "" {
			return usage("loop: missing --%s", f)
		}
	}
	ctx := context.Background()
	attach, attachPath, err := cubeMethod(ctx, seen["proto"], "attach")
	if err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient:", err)
		return 2
	}
	detach, detachPath, err := cubeMethod(ctx, seen["proto"], "detach")
	if err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient:", err)
		return 2
	}
	// Once, for the process lifetime, as Cubelet does.
	conn, err := dial(seen["target"])
	if err != nil {
		printJSON(map[string]any{"calls": 0, "failures": []string{err.Error()}})
		return 1
	}
	defer conn.Close()
	calls, failures := 0, []string{}
	for n := 1; ; n++ {
		if _, err := os.Stat(seen["stop-file"]); err == nil {
			break
		}
		sandbox := fmt.Sprintf("loop-%d", n)
		req := dynamicpb.NewMessage(attach.Input())
		setString(req, "sandbox_id", sandbox)
		setString(req, "namespace", "default")
		setString(req, "volume_id", seen["volume-id"])
		setString(req, "volume_base_dir", seen["volume-base-dir"])
		setInt64(req, "ref_count", 0)
		setString(req, "private_data", seen["private-data"])
		resp := dynamicpb.NewMessage(attach.Output())
		calls++
		if err := conn.Invoke(ctx, attachPath, req, resp); err != nil {
			failures = append(failures, fmt.Sprintf("attach %s: %s", sandbox, status.Convert(err).Message()))
			time.Sleep(50 * time.Millisecond)
			continue
		}
		dreq := dynamicpb.NewMessage(detach.Input())
		setString(dreq, "sandbox_id", sandbox)
		setString(dreq, "namespace", "default")
		setString(dreq, "volume_id", seen["volume-id"])
		setInt64(dreq, "ref_count", 0)
		meta := dreq.Mutable(detach.Input().Fields().ByName("metadata")).Map()
		resp.Get(attach.Output().Fields().ByName("metadata")).Map().Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
			meta.Set(k, v)
			return true
		})
		calls++
		if err := conn.Invoke(ctx, detachPath, dreq, dynamicpb.NewMessage(detach.Output())); err != nil {
			failures = append(failures, fmt.Sprintf("detach %s: %s", sandbox, status.Convert(err).Message()))
		}
	}
	printJSON(map[string]any{"calls": calls, "failures": failures})
	if len(failures) > 0 {
		return 1
	}
	return 0
}
