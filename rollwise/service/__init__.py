"""Training as a service: a Tinker-compatible API (`rollwise serve tinker`) over rollwise's trainer
and engines, many tenants at once. The wire format is the `tinker` SDK's own (its published protobuf
module `tinker.proto.tinker_public_pb2` and its pydantic request types); nothing is re-declared here."""
