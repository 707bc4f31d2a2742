"""The committed stubs of radixserve's gRPC API are generated from the committed .proto
(scripts/gen_proto.sh): compiled again here, the file descriptor is the same, and the service
stub has every method the proto declares."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2

from shared.grpc_api import radixserve_pb2, radixserve_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def strip_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        strip_json_names(message.nested_type)


def test_the_stubs_are_generated_from_the_proto(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--descriptor_set_out={out}",
            "shared/grpc_api/radixserve.proto",
        ],
        check=True,
        cwd=ROOT,
    )
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    strip_json_names(compiled.message_type)  # the generated module leaves out derived ones
    committed = descriptor_pb2.FileDescriptorProto.FromString(
        radixserve_pb2.DESCRIPTOR.serialized_pb
    )
    assert committed == compiled, "run scripts/gen_proto.sh and commit its output"
    service = compiled.service[0]
    stub = radixserve_pb2_grpc.RadixServeStub
    servicer = radixserve_pb2_grpc.RadixServeServicer
    for method in service.method:
        assert hasattr(servicer, method.name), method.name
    assert stub.__init__.__code__.co_names  # a generated stub, not a placeholder
