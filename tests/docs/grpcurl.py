"""A stand-in for the ``grpcurl`` command, for machines without it: the subset the docs use.

``grpcurl -plaintext [-H 'key: value']... [-d JSON] HOST:PORT list | SERVICE/METHOD``. It works
as grpcurl does, through the server's reflection service (nothing is compiled in), and prints
what grpcurl prints: service names one a line, or each response message as JSON (proto3 JSON
names, default values left out). The doc tests put it on PATH only when grpcurl is missing.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="grpcurl")
    parser.add_argument("-plaintext", action="store_true")
    parser.add_argument("-d", dest="data", default="{}")
    parser.add_argument("-H", dest="headers", action="append", default=[])
    parser.add_argument("target")
    parser.add_argument("what")
    args = parser.parse_args(argv)
    if not args.plaintext:
        print("this stand-in speaks plaintext only", file=sys.stderr)
        return 2
    metadata = []
    for header in args.headers:
        key, _, value = header.partition(":")
        metadata.append((key.strip().lower(), value.strip()))
    with grpc.insecure_channel(args.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        if args.what == "list":
            print("\n".join(sorted(database.get_services())))
            return 0
        service_name, _, method_name = args.what.replace("/", ".").rpartition(".")
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName(service_name).FindMethodByName(method_name)
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(args.data, request_class())
        path = f"/{service_name}/{method_name}"
        serialize, parse = request_class.SerializeToString, response_class.FromString
        try:
            if method.server_streaming:
                responses = channel.unary_stream(path, serialize, parse)(request, metadata=metadata)
            else:
                responses = [channel.unary_unary(path, serialize, parse)(request, metadata=metadata)]
            for response in responses:
                print(json_format.MessageToJson(response, indent=2))
        except grpc.RpcError as exc:
            print(f"ERROR:\n  Code: {exc.code().name}\n  Message: {exc.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
