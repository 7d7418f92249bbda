"""The protocol-agnostic engine core. Never imports grpc or generated protobuf code."""
