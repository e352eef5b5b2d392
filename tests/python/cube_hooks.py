#!/usr/bin/env python3
"""A Cube caller written with grpcio (grpc-core's Python binding), as a new user writes one.

Used by tests/any_grpc_client.rs. The channel is grpc.insecure_channel(TARGET) with
default options, so grpc-core chooses the HTTP/2 :authority itself (for unix:///path,
the percent-encoded socket path). The stubs are generated from the Cube proto at start,
into a temporary directory, with grpcio-tools.

    cube_hooks.py TARGET PROTO_ROOT

Reads one call per stdin line, {"method": "Create"|"Destroy"|"Attach"|"Detach",
"request": {...}} (proto field names), and writes one line per call:
{"ok": true, "response": {...}} or {"ok": false, "code": "INTERNAL", "details": "..."}.
Every call goes over the one channel, as a long-lived client's calls do.
"""

import json
import sys
import tempfile

import grpc
from google.protobuf import json_format
from grpc_tools import protoc

PROTO = "cube/v1/volumeplugin.proto"
CALL_TIMEOUT_SECS = 60


def load_stubs(proto_root, out_dir):
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc could not compile {PROTO} under {proto_root}")
    sys.path.insert(0, out_dir)
    from cube.v1 import volumeplugin_pb2, volumeplugin_pb2_grpc

    return volumeplugin_pb2, volumeplugin_pb2_grpc


def main():
    if len(sys.argv) != 3:
        raise SystemExit("usage: cube_hooks.py TARGET PROTO_ROOT")
    target, proto_root = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory(prefix="ccb-py-stubs-") as stubs:
        pb, rpc = load_stubs(proto_root, stubs)
        with grpc.insecure_channel(target) as channel:
            controller = rpc.VolumeControllerServiceStub(channel)
            node = rpc.VolumePluginServiceStub(channel)
            hooks = {
                "Create": (controller.Create, pb.CreateRequest),
                "Destroy": (controller.Destroy, pb.DestroyRequest),
                "Attach": (node.Attach, pb.AttachRequest),
                "Detach": (node.Detach, pb.DetachRequest),
            }
            for line in sys.stdin:
                if not line.strip():
                    continue
                call = json.loads(line)
                method, message = hooks[call["method"]]
                request = json_format.ParseDict(call.get("request", {}), message())
                try:
                    response = method(request, timeout=CALL_TIMEOUT_SECS)
                    answer = {
                        "ok": True,
                        "response": json_format.MessageToDict(
                            response, preserving_proto_field_name=True
                        ),
                    }
                except grpc.RpcError as error:
                    answer = {
                        "ok": False,
                        "code": error.code().name,
                        "details": error.details(),
                    }
                print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
