// Test peers for cube-csi-bridge's end-to-end tests: cubeclient, a Cube-like
// caller, and (as a tool) the Kubernetes CSI mock driver from csi-test v4.2.0,
// the last csi-test release that has it. Built by
// scripts/install-test-peers.sh; see README.md.
module cubecsibridge/tests/peers

go 1.26.0

require (
	github.com/bufbuild/protocompile v0.14.1
	google.golang.org/grpc v1.80.0
	google.golang.org/protobuf v1.36.11
)

require (
	github.com/container-storage-interface/spec v1.3.0 // indirect
	github.com/davecgh/go-spew v1.1.2-0.20180830191138-d8f796af33cc // indirect
	github.com/go-logr/logr v1.4.3 // indirect
	github.com/golang/mock v1.4.4 // indirect
	github.com/golang/protobuf v1.5.4 // indirect
	github.com/kubernetes-csi/csi-test/v4 v4.2.0 // indirect
	github.com/pmezard/go-difflib v1.0.1-0.20181226105442-5d4384ee4fb2 // indirect
	github.com/robertkrimen/otto v0.0.0-20200922221731-ef014fd054ac // indirect
	github.com/sirupsen/logrus v1.7.0 // indirect
	github.com/stretchr/testify v1.11.1 // indirect
	golang.org/x/net v0.49.0 // indirect
	golang.org/x/sync v0.19.0 // indirect
	golang.org/x/sys v0.46.0 // indirect
	golang.org/x/text v0.33.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260120221211-b8f7ae30c516 // indirect
	gopkg.in/sourcemap.v1 v1.0.5 // indirect
	gopkg.in/yaml.v2 v2.4.0 // indirect
	// csi-test v4.2.0 asks for klog v2.4.0, which does not compile against the
	// go-logr v1 that grpc v1.80 brings in; v2.140.0 does.
	k8s.io/klog/v2 v2.140.0 // indirect
)

tool github.com/kubernetes-csi/csi-test/v4/cmd/mock-driver
