"""Generated protobuf and gRPC code (see scripts/gen_proto.py)."""
