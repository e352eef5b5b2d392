package main

// The benchmark side of cubeclient (benches/suite drives it; see docs/benchmarks.md):
//
//	cubeclient bench          reads phases, one JSON object a line, on stdin; runs each;
//	                          answers one JSON object a line on stdout
//	cubeclient floor-plugin --listen SOCK
//	                          a trivial grpc-go Cube plugin that answers every hook at
//	                          once: the floor of one gRPC hop as Cube sees it
//
// A phase is a list of Cube hook calls, made in order by `concurrency` workers, each call
// timed on its own. rpc calls go over one grpc.ClientConn per target, made as Cubelet
// makes it (grpc.NewClient, insecure, unix://) and reused for the life of the process, as
// Cubelet reuses it. Binary calls fork the executable with Cube's exact argv and judge
// its stdout as Cube does (or, with "raw", only its exit status: the exec floor).
//
// Between calls the runner remembers what Cube would, per plugin (socket or executable):
// the private_data a Create returned (for a later Attach of that volume that names none)
// and the metadata an Attach returned (for a later Detach of that volume that names none).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

// benchCall is one hook call of a phase.
type benchCall struct {
	Op            string            `json:"op"`
	VolumeID      string            `json:"volume_id"`
	Name          string            `json:"name,omitempty"`
	SandboxID     string            `json:"sandbox_id,omitempty"`
	Namespace     string            `json:"namespace,omitempty"`
	RefCount      int64             `json:"ref_count,omitempty"`
	VolumeBaseDir string            `json:"volume_base_dir,omitempty"`
	PrivateData   *string           `json:"private_data,omitempty"`
	Metadata      map[string]string `json:"metadata,omitempty"`
}

// benchPhase is one line of input.
type benchPhase struct {
	Name string `json:"name"`
	// Exactly one of Target (rpc) and Binary (fork).
	Target string `json:"target,omitempty"`
	Binary string `json:"binary,omitempty"`
	// Extra environment of forked hooks, KEY=VALUE.
	Env []string `json:"env,omitempty"`
	// Raw: judge a forked call by its exit status only (for an exec floor such as /bin/true).
	Raw         bool        `json:"raw,omitempty"`
	Concurrency int         `json:"concurrency,omitempty"`
	Calls       []benchCall `json:"calls"`
}

// benchResult is one line of output.
type benchResult struct {
	Name string `json:"name"`
	// From the moment every worker was ready to the end of the last call.
	WallNs int64 `json:"wall_ns"`
	// One per call, in call order.
	SamplesNs  []int64 `json:"samples_ns"`
	Errors     int     `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
}

// benchState is what the runner remembers between calls and phases.
type benchState struct {
	mu      sync.Mutex
	conns   map[string]*grpc.ClientConn
	methods map[string]methodInfo
	// Keyed by plugin, then volume_id.
	privateData map[string]string
	metadata    map[string]map[string]string
}

// memoryKey names one volume of one plugin.
func memoryKey(ph *benchPhase, call *benchCall) string {
	return ph.Target + "\x00" + ph.Binary + "\x00" + call.VolumeID
}

type methodInfo struct {
	desc protoreflect.MethodDescriptor
	path string
}

func runBench(args []string) int {
	if len(args) != 0 {
		return usage("bench takes no arguments; it reads phases on stdin")
	}
	st := &benchState{
		conns:       map[string]*grpc.ClientConn{},
		methods:     map[string]methodInfo{},
		privateData: map[string]string{},
		metadata:    map[string]map[string]string{},
	}
	for _, op := range []string{"create", "destroy", "attach", "detach"} {
		md, path, err := cubeMethod(context.Background(), "", op)
		if err != nil {
			fmt.Fprintln(os.Stderr, "cubeclient bench:", err)
			return 2
		}
		st.methods[op] = methodInfo{desc: md, path: path}
	}
	defer func() {
		for _, c := range st.conns {
			c.Close()
		}
	}()
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<30)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var ph benchPhase
		if err := json.Unmarshal(in.Bytes(), &ph); err != nil {
			fmt.Fprintln(os.Stderr, "cubeclient bench: bad phase:", err)
			return 2
		}
		if (ph.Target == "") == (ph.Binary == "") {
			fmt.Fprintf(os.Stderr, "cubeclient bench: phase %q needs exactly one of target and binary\n", ph.Name)
			return 2
		}
		res := st.runPhase(&ph)
		if err := out.Encode(res); err != nil {
			return 1
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient bench:", err)
		return 1
	}
	return 0
}

func (st *benchState) conn(target string) (*grpc.ClientConn, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if c, ok := st.conns[target]; ok {
		return c, nil
	}
	c, err := dial(target)
	if err != nil {
		return nil, err
	}
	st.conns[target] = c
	return c, nil
}

func (st *benchState) runPhase(ph *benchPhase) benchResult {
	res := benchResult{Name: ph.Name, SamplesNs: make([]int64, len(ph.Calls))}
	var conn *grpc.ClientConn
	if ph.Target != "" {
		var err error
		if conn, err = st.conn(ph.Target); err != nil {
			res.Errors = len(ph.Calls)
			res.FirstError = err.Error()
			return res
		}
	}
	workers := ph.Concurrency
	if workers < 1 {
		workers = 1
	}
	if workers > len(ph.Calls) {
		workers = len(ph.Calls)
	}
	next := make(chan int, len(ph.Calls))
	for i := range ph.Calls {
		next <- i
	}
	close(next)
	var errMu sync.Mutex
	var ready, done sync.WaitGroup
	start := make(chan struct{})
	ready.Add(workers)
	done.Add(workers)
	for w := 0; w < workers; w++ {
		go func() {
			defer done.Done()
			ready.Done()
			<-start
			for i := range next {
				call := &ph.Calls[i]
				t0 := time.Now()
				var err error
				if conn != nil {
					err = st.invoke(conn, ph, call)
				} else {
					err = st.fork(ph, call)
				}
				res.SamplesNs[i] = time.Since(t0).Nanoseconds()
				if err != nil {
					errMu.Lock()
					if res.Errors == 0 {
						res.FirstError = fmt.Sprintf("call %d (%s %s): %v", i, call.Op, call.VolumeID, err)
					}
					res.Errors++
					errMu.Unlock()
				}
			}
		}()
	}
	// Every worker is parked on start: the calls begin together.
	ready.Wait()
	t0 := time.Now()
	close(start)
	done.Wait()
	res.WallNs = time.Since(t0).Nanoseconds()
	return res
}

// request builds the wire request of one call, filling in what Cube would remember.
func (st *benchState) request(ph *benchPhase, call *benchCall) (*dynamicpb.Message, methodInfo, error) {
	m, ok := st.methods[call.Op]
	if !ok {
		return nil, m, fmt.Errorf("unknown op %q", call.Op)
	}
	req := dynamicpb.NewMessage(m.desc.Input())
	switch call.Op {
	case "create":
		setString(req, "volume_id", call.VolumeID)
		setString(req, "name", call.Name)
	case "destroy":
		setString(req, "volume_id", call.VolumeID)
	case "attach":
		setString(req, "sandbox_id", call.SandboxID)
		setString(req, "namespace", call.Namespace)
		setString(req, "volume_id", call.VolumeID)
		setString(req, "volume_base_dir", call.VolumeBaseDir)
		setInt64(req, "ref_count", call.RefCount)
		setString(req, "private_data", st.privateDataOf(ph, call))
	case "detach":
		setString(req, "sandbox_id", call.SandboxID)
		setString(req, "namespace", call.Namespace)
		setString(req, "volume_id", call.VolumeID)
		setInt64(req, "ref_count", call.RefCount)
		mp := req.Mutable(m.desc.Input().Fields().ByName("metadata")).Map()
		for k, v := range st.metadataOf(ph, call) {
			mp.Set(protoreflect.ValueOfString(k).MapKey(), protoreflect.ValueOfString(v))
		}
	}
	return req, m, nil
}

func (st *benchState) privateDataOf(ph *benchPhase, call *benchCall) string {
	if call.PrivateData != nil {
		return *call.PrivateData
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.privateData[memoryKey(ph, call)]
}

func (st *benchState) metadataOf(ph *benchPhase, call *benchCall) map[string]string {
	if call.Metadata != nil {
		return call.Metadata
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.metadata[memoryKey(ph, call)]
}

func (st *benchState) remember(ph *benchPhase, call *benchCall, privateData *string, metadata map[string]string) {
	st.mu.Lock()
	defer st.mu.Unlock()
	if privateData != nil {
		st.privateData[memoryKey(ph, call)] = *privateData
	}
	if metadata != nil {
		st.metadata[memoryKey(ph, call)] = metadata
	}
}

func (st *benchState) invoke(conn *grpc.ClientConn, ph *benchPhase, call *benchCall) error {
	req, m, err := st.request(ph, call)
	if err != nil {
		return err
	}
	resp := dynamicpb.NewMessage(m.desc.Output())
	if err := conn.Invoke(context.Background(), m.path, req, resp); err != nil {
		s := status.Convert(err)
		return fmt.Errorf("%s: %s", s.Code(), s.Message())
	}
	switch call.Op {
	case "create":
		pd := getString(resp, "private_data")
		st.remember(ph, call, &pd, nil)
	case "attach":
		md := map[string]string{}
		resp.Get(m.desc.Output().Fields().ByName("metadata")).Map().Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
			md[k.String()] = v.String()
			return true
		})
		st.remember(ph, call, nil, md)
	}
	return nil
}

// fork runs one call as Cube's binary plugin type does: Cube's argv, inherited
// environment (plus the phase's), empty stdin, stdout and stderr captured.
func (st *benchState) fork(ph *benchPhase, call *benchCall) error {
	r := &opRequest{
		op: call.Op, volumeID: call.VolumeID, name: call.Name, sandboxID: call.SandboxID,
		namespace: call.Namespace, refCount: call.RefCount, volumeBaseDir: call.VolumeBaseDir,
	}
	switch call.Op {
	case "attach":
		r.privateData = st.privateDataOf(ph, call)
	case "detach":
		r.metadata = st.metadataOf(ph, call)
	}
	argv, err := binaryArgv(r)
	if err != nil {
		return err
	}
	cmd := exec.Command(ph.Binary, argv...)
	if len(ph.Env) > 0 {
		cmd.Env = append(os.Environ(), ph.Env...)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%v: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	if ph.Raw {
		return nil
	}
	var v struct {
		PrivateData *string           `json:"private_data"`
		Metadata    map[string]string `json:"metadata"`
		Error       string            `json:"error"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &v); err != nil {
		return fmt.Errorf("decode %s output %q: %v", call.Op, stdout.String(), err)
	}
	if v.Error != "" {
		return fmt.Errorf("%s", v.Error)
	}
	switch call.Op {
	case "create":
		st.remember(ph, call, v.PrivateData, nil)
	case "attach":
		if v.Metadata == nil {
			v.Metadata = map[string]string{}
		}
		st.remember(ph, call, nil, v.Metadata)
	}
	return nil
}

// runFloorPlugin serves both Cube services with handlers that decode the request and
// answer at once: one gRPC hop, as cheap as grpc-go makes it.
func runFloorPlugin(args []string) int {
	var listen string
	for len(args) > 0 {
		name, val, rest, err := takeFlag(args)
		if err != nil {
			return usage("floor-plugin: %v", err)
		}
		args = rest
		if name != "listen" {
			return usage("floor-plugin: unknown flag --%s", name)
		}
		listen = val
	}
	if listen == "" {
		return usage("floor-plugin needs --listen SOCK")
	}
	methods := map[string]methodInfo{}
	for _, op := range []string{"create", "destroy", "attach", "detach"} {
		md, path, err := cubeMethod(context.Background(), "", op)
		if err != nil {
			fmt.Fprintln(os.Stderr, "cubeclient floor-plugin:", err)
			return 2
		}
		methods[op] = methodInfo{desc: md, path: path}
	}
	_ = os.Remove(listen)
	lis, err := net.Listen("unix", listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient floor-plugin:", err)
		return 1
	}
	srv := grpc.NewServer()
	for _, svc := range []struct {
		name string
		ops  []string
	}{
		{"VolumePluginService", []string{"attach", "detach"}},
		{"VolumeControllerService", []string{"create", "destroy"}},
	} {
		desc := grpc.ServiceDesc{
			ServiceName: protoPackage + "." + svc.name,
			HandlerType: (*any)(nil),
		}
		for _, op := range svc.ops {
			m := methods[op]
			desc.Methods = append(desc.Methods, grpc.MethodDesc{
				MethodName: string(m.desc.Name()),
				Handler:    floorHandler(m.desc),
			})
		}
		srv.RegisterService(&desc, struct{}{})
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sigs
		srv.Stop()
	}()
	if err := srv.Serve(lis); err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient floor-plugin:", err)
		return 1
	}
	return 0
}

// floorHandler decodes the request and returns a reply of the usual shape (an Attach
// reply carries a host_path and one metadata entry, as a real plugin's does).
func floorHandler(md protoreflect.MethodDescriptor) func(any, context.Context, func(any) error, grpc.UnaryServerInterceptor) (any, error) {
	return func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
		in := dynamicpb.NewMessage(md.Input())
		if err := dec(in); err != nil {
			return nil, err
		}
		out := dynamicpb.NewMessage(md.Output())
		if md.Name() == "Attach" {
			setString(out, "host_path", getString(in, "volume_base_dir")+"/floor-"+getString(in, "volume_id"))
			mp := out.Mutable(md.Output().Fields().ByName("metadata")).Map()
			mp.Set(protoreflect.ValueOfString("mount_dir").MapKey(), protoreflect.ValueOfString(getString(out, "host_path")))
		}
		return out, nil
	}
}
