package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/bufbuild/protocompile"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"
)

// protoB64 is the Cube proto, base64-encoded, set at link time by
// scripts/install-test-peers.sh (-X main.protoB64=...).
var protoB64 = ""

const (
	protoPackage    = "cubelet.services.volumeplugin.v1"
	protoRepoPath   = "proto/cube/v1/volumeplugin.proto"
	protoVirtualKey = "volumeplugin.proto"
)

// loadProtoSource finds the text of volumeplugin.proto.
func loadProtoSource(flagPath string) (string, error) {
	if flagPath != "" {
		b, err := os.ReadFile(flagPath)
		return string(b), err
	}
	if p := os.Getenv("CUBE_VOLUMEPLUGIN_PROTO"); p != "" {
		b, err := os.ReadFile(p)
		return string(b), err
	}
	if protoB64 != "" {
		b, err := base64.StdEncoding.DecodeString(protoB64)
		if err != nil {
			return "", fmt.Errorf("embedded proto: %v", err)
		}
		return string(b), nil
	}
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if exe, err := os.Executable(); err == nil {
		starts = append(starts, filepath.Dir(exe))
	}
	for _, dir := range starts {
		for {
			p := filepath.Join(dir, protoRepoPath)
			if b, err := os.ReadFile(p); err == nil {
				return string(b), nil
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return "", fmt.Errorf("cannot find %s: pass --proto or set CUBE_VOLUMEPLUGIN_PROTO", protoRepoPath)
}

// cubeMethod returns the method descriptor and full gRPC path of one hook.
func cubeMethod(ctx context.Context, protoFlag, op string) (protoreflect.MethodDescriptor, string, error) {
	src, err := loadProtoSource(protoFlag)
	if err != nil {
		return nil, "", err
	}
	c := protocompile.Compiler{Resolver: &protocompile.SourceResolver{
		Accessor: protocompile.SourceAccessorFromMap(map[string]string{protoVirtualKey: src}),
	}}
	files, err := c.Compile(ctx, protoVirtualKey)
	if err != nil {
		return nil, "", fmt.Errorf("compile Cube proto: %v", err)
	}
	fd := files[0]
	if string(fd.Package()) != protoPackage {
		return nil, "", fmt.Errorf("Cube proto has package %q, want %q", fd.Package(), protoPackage)
	}
	sm, ok := map[string][2]string{
		"create":  {"VolumeControllerService", "Create"},
		"destroy": {"VolumeControllerService", "Destroy"},
		"attach":  {"VolumePluginService", "Attach"},
		"detach":  {"VolumePluginService", "Detach"},
	}[op]
	if !ok {
		return nil, "", fmt.Errorf("unknown op %q", op)
	}
	svcName, method := sm[0], sm[1]
	svc := fd.Services().ByName(protoreflect.Name(svcName))
	if svc == nil {
		return nil, "", fmt.Errorf("Cube proto has no service %s", svcName)
	}
	m := svc.Methods().ByName(protoreflect.Name(method))
	if m == nil {
		return nil, "", fmt.Errorf("Cube proto has no method %s.%s", svcName, method)
	}
	return m, "/" + string(svc.FullName()) + "/" + string(m.Name()), nil
}

// normalizeTarget turns a plugin socket setting into a gRPC target as Cube does:
// trimmed; "://" passes through; a leading "/" becomes unix://<path>; anything
// else (host:port) passes through.
func normalizeTarget(t string) string {
	t = strings.TrimSpace(t)
	switch {
	case strings.Contains(t, "://"):
		return t
	case strings.HasPrefix(t, "/"):
		return "unix://" + t
	}
	return t
}

// dial connects exactly as Cubelet and CubeMaster do: lazy, plaintext, no options.
func dial(target string) (*grpc.ClientConn, error) {
	return grpc.NewClient(normalizeTarget(target), grpc.WithTransportCredentials(insecure.NewCredentials()))
}

func setString(m *dynamicpb.Message, field, v string) {
	m.Set(m.Descriptor().Fields().ByName(protoreflect.Name(field)), protoreflect.ValueOfString(v))
}

func setInt64(m *dynamicpb.Message, field string, v int64) {
	m.Set(m.Descriptor().Fields().ByName(protoreflect.Name(field)), protoreflect.ValueOfInt64(v))
}

func getString(m *dynamicpb.Message, field string) string {
	return m.Get(m.Descriptor().Fields().ByName(protoreflect.Name(field))).String()
}

func runRPC(ctx context.Context, g globals, r *opRequest) int {
	md, path, err := cubeMethod(ctx, g.proto, r.op)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cubeclient:", err)
		return 2
	}
	req := dynamicpb.NewMessage(md.Input())
	resp := dynamicpb.NewMessage(md.Output())
	switch r.op {
	case "create":
		setString(req, "volume_id", r.volumeID)
		setString(req, "name", r.name)
	case "destroy":
		setString(req, "volume_id", r.volumeID)
	case "attach":
		setString(req, "sandbox_id", r.sandboxID)
		setString(req, "namespace", r.namespace)
		setString(req, "volume_id", r.volumeID)
		setString(req, "volume_base_dir", r.volumeBaseDir)
		setInt64(req, "ref_count", r.refCount)
		setString(req, "private_data", r.privateData)
	case "detach":
		setString(req, "sandbox_id", r.sandboxID)
		setString(req, "namespace", r.namespace)
		setString(req, "volume_id", r.volumeID)
		setInt64(req, "ref_count", r.refCount)
		fd := md.Input().Fields().ByName("metadata")
		mp := req.Mutable(fd).Map()
		for k, v := range r.metadata {
			mp.Set(protoreflect.ValueOfString(k).MapKey(), protoreflect.ValueOfString(v))
		}
	}
	conn, err := dial(g.target)
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
	switch r.op {
	case "create":
		printJSON(createOut{Token: getString(resp, "token"), PrivateData: getString(resp, "private_data")})
	case "attach":
		out := attachOut{HostPath: getString(resp, "host_path"), Metadata: map[string]string{}}
		resp.Get(md.Output().Fields().ByName("metadata")).Map().Range(func(k protoreflect.MapKey, v protoreflect.Value) bool {
			out.Metadata[k.String()] = v.String()
			return true
		})
		printJSON(out)
	default:
		printJSON(emptyOut{})
	}
	return 0
}
