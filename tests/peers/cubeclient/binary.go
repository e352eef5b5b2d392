package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// binaryArgv builds the argv after the executable exactly as Cubelet/CubeMaster
// do (cube-hook-protocol.md §3.1): fixed order, flag and value as separate
// elements, --private-data only when non-empty, --metadata always on detach.
func binaryArgv(r *opRequest) ([]string, error) {
	switch r.op {
	case "create":
		return []string{"--op", "create", "--volume-id", r.volumeID, "--name", r.name}, nil
	case "destroy":
		return []string{"--op", "destroy", "--volume-id", r.volumeID}, nil
	case "attach":
		a := []string{"--op", "attach", "--sandbox-id", r.sandboxID, "--namespace", r.namespace,
			"--volume-id", r.volumeID, "--ref-count", strconv.FormatInt(r.refCount, 10),
			"--volume-base-dir", r.volumeBaseDir}
		if r.privateData != "" {
			a = append(a, "--private-data", r.privateData)
		}
		return a, nil
	case "detach":
		md := []byte("{}")
		if r.metadata != nil {
			var err error
			// Go's json.Marshal: compact, sorted keys, <>& escaped, as Cube sends it.
			if md, err = json.Marshal(r.metadata); err != nil {
				return nil, err
			}
		}
		return []string{"--op", "detach", "--sandbox-id", r.sandboxID, "--namespace", r.namespace,
			"--volume-id", r.volumeID, "--ref-count", strconv.FormatInt(r.refCount, 10),
			"--metadata", string(md)}, nil
	}
	return nil, fmt.Errorf("unknown op %q", r.op)
}

// The structs Cube decodes a hook's stdout into (§3.3). encoding/json is used
// as Cube uses it, so its rules apply: unknown keys ignored, missing keys are
// zero values, key matching is case-insensitive, and type mismatches fail.
type binCreate struct {
	Token       string `json:"token"`
	PrivateData string `json:"private_data"`
	Error       string `json:"error"`
}

type binAttach struct {
	HostPath string            `json:"host_path"`
	Metadata map[string]string `json:"metadata"`
	Error    string            `json:"error"`
}

type binError struct {
	Error string `json:"error"`
}

type binFailure struct {
	Error    string `json:"error"`
	ExitCode int    `json:"exit_code"`
	Stdout   string `json:"stdout"`
}

func runBinary(ctx context.Context, g globals, r *opRequest) int {
	argv, err := binaryArgv(r)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient:", err)
		return 2
	}
	// No shell, inherited environment and working directory, empty stdin,
	// SIGKILL when the context ends; Wait also waits for every holder of the
	// stdout/stderr pipes, as os/exec does for Cube (no WaitDelay).
	cmd := exec.CommandContext(ctx, g.path, argv...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	runErr := cmd.Run()
	// The hook's stderr is Cube's log only; pass it on to ours for debugging.
	os.Stderr.Write(stderr.Bytes())

	fail := func(msg string, code int) int {
		printJSON(binFailure{Error: msg, ExitCode: code, Stdout: stdout.String()})
		return 1
	}
	if runErr != nil {
		code := -1
		var ee *exec.ExitError
		if errors.As(runErr, &ee) {
			code = ee.ExitCode()
		}
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = strings.TrimSpace(stdout.String())
		}
		if msg == "" || code == -1 && !errors.As(runErr, &ee) {
			msg = runErr.Error()
		}
		return fail(msg, code)
	}

	out := stdout.Bytes()
	switch r.op {
	case "create":
		var v binCreate
		if err := json.Unmarshal(out, &v); err != nil {
			return fail(fmt.Sprintf("decode create output: %v", err), 0)
		}
		if v.Error != "" {
			return fail(v.Error, 0)
		}
		printJSON(createOut{Token: v.Token, PrivateData: v.PrivateData})
	case "attach":
		var v binAttach
		if err := json.Unmarshal(out, &v); err != nil {
			return fail(fmt.Sprintf("decode attach output: %v", err), 0)
		}
		if v.Error != "" {
			return fail(v.Error, 0)
		}
		if v.Metadata == nil {
			v.Metadata = map[string]string{}
		}
		printJSON(attachOut{HostPath: v.HostPath, Metadata: v.Metadata})
	default:
		var v binError
		if err := json.Unmarshal(out, &v); err != nil {
			return fail(fmt.Sprintf("decode %s output: %v", r.op, err), 0)
		}
		if v.Error != "" {
			return fail(v.Error, 0)
		}
		printJSON(emptyOut{})
	}
	return 0
}
