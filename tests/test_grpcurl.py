"""The grpcurl examples of the gRPC door's page (docs/doors/grpc.md), run as written through a reflection
client (what grpcurl does: no proto files, descriptors from the server, requests from JSON; `-d @` reads
the request from what the shell pipes in, as the page's Recognize line does)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.daemon_harness import start_daemon
from tests.speech import layout, write_wav
from tests.whisper_fixtures import make_openai_checkpoint

GRPC_DOC = Path(__file__).resolve().parent.parent / "docs" / "doors" / "grpc.md"


def documented_grpcurl_commands() -> list[str]:
    text = GRPC_DOC.read_text()
    block = re.search(r"## grpcurl\n.*?```sh\n(.*?)```", text, re.S)
    assert block, "docs/doors/grpc.md has no grpcurl example block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [line for line in lines if "grpcurl " in line]


class Grpcurl:
    """The subset of grpcurl the README uses: list, describe, and -d JSON calls of unary methods."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def __call__(self, args: list[str], stdin: str = "") -> object:
        assert args[0] == "grpcurl" and "-plaintext" in args
        args = [a for a in args[1:] if a != "-plaintext"]
        data = None
        if "-d" in args:
            i = args.index("-d")
            data = stdin if args[i + 1] == "@" else args[i + 1]
            del args[i : i + 2]
        _address, *rest = args
        if rest == ["list"]:
            return self.db.get_services()
        if rest[0] == "describe":
            return self.pool.FindServiceByName(rest[1])
        service, method = rest[0].split("/")
        m = self.pool.FindServiceByName(service).methods_by_name[method]
        request = GetMessageClass(m.input_type)()
        json_format.Parse(data or "{}", request)
        reply_class = GetMessageClass(m.output_type)
        call = self.channel.unary_unary(f"/{service}/{method}", request_serializer=lambda r: r.SerializeToString(),
                                        response_deserializer=reply_class.FromString)
        return json_format.MessageToDict(call(request, timeout=60), preserving_proto_field_name=False)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(make_openai_checkpoint(tmp_path_factory.mktemp("whisper"), seed=5))
    yield d
    d.stop()


def test_documented_grpcurl_examples_work_as_written(daemon, tmp_path):
    # the documented Recognize command reads hello.wav from the folder it runs in
    write_wav(tmp_path / "hello.wav", layout(["Hello, this is a test."], lead_s=0.2, tail_s=0.3).audio)
    commands = documented_grpcurl_commands()
    assert len(commands) >= 5
    with grpc.insecure_channel(daemon.address) as channel:
        grpcurl = Grpcurl(channel)
        outputs = {}
        for line in commands:
            line = line.replace("127.0.0.1:50051", daemon.address)
            stdin = ""
            if "| grpcurl " in line:  # the request made by the shell, as a user's shell would make it
                producer, rest = line.split("| grpcurl ", 1)
                stdin = subprocess.run(["bash", "-c", producer], cwd=tmp_path, capture_output=True, text=True,
                                       check=True).stdout
                line = "grpcurl " + rest
            args = shlex.split(line)
            outputs[args[-1]] = grpcurl(args, stdin)
    assert {"voiced.v1.Voiced", "grpc.health.v1.Health"} <= set(outputs["list"])
    assert "Converse" in outputs["voiced.v1.Voiced"].methods_by_name
    assert outputs["grpc.health.v1.Health/Check"] == {"status": "SERVING"}
    assert outputs["voiced.v1.Voiced/GetServerInfo"]["asr"]["backend"] == "torch"
    results = outputs["voiced.v1.Voiced/Recognize"]["results"]
    assert len(results) == 1 and results[0]["isFinal"] and results[0]["language"] == "en"
    assert len(results[0]["tokens"]) > 0
