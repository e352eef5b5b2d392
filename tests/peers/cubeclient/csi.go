package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

// runCSI calls one unary CSI method by name, e.g.
//
//	cubeclient csi --endpoint /tmp/x/csi.sock CreateVolume '{"name":"v1",...}'
//
// The request is protojson (proto or JSON field names); the response is printed
// as one protojson line with proto field names. A gRPC error prints
// {"error","code"} and exits 1.
func runCSI(ctx context.Context, g globals, args []string) int {
	if len(args) < 1 || len(args) > 2 {
		return usage("csi: want METHOD [REQUEST_JSON]")
	}
	name, body := args[0], "{}"
	if len(args) == 2 {
		body = args[1]
	}
	var md protoreflect.MethodDescriptor
	var path string
	svcs := csi.File_csi_proto.Services()
	for i := 0; i < svcs.Len() && md == nil; i++ {
		if m := svcs.Get(i).Methods().ByName(protoreflect.Name(name)); m != nil && !m.IsStreamingClient() && !m.IsStreamingServer() {
			md, path = m, "/"+string(svcs.Get(i).FullName())+"/"+string(m.Name())
		}
	}
	if md == nil {
		return usage("csi: no unary CSI method %q", name)
	}
	req := dynamicpb.NewMessage(md.Input())
	if err := protojson.Unmarshal([]byte(body), req); err != nil {
		return usage("csi: bad %s request: %v", name, err)
	}
	resp := dynamicpb.NewMessage(md.Output())
	conn, err := dial(g.endpoint)
	if err != nil {
		printJSON(map[string]string{"error": err.Error(), "code": "Unknown"})
		return 1
	}
	defer conn.Close()
	if err := conn.Invoke(ctx, path, req, resp); err != nil {
		st := status.Convert(err)
		printJSON(map[string]string{"error": st.Message(), "code": st.Code().String()})
		return 1
	}
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(resp)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient:", err)
		return 1
	}
	// protojson output is not guaranteed compact; make it one line.
	fmt.Println(compactJSON(b))
	return 0
}

func compactJSON(b []byte) string {
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return string(b)
	}
	return buf.String()
}
