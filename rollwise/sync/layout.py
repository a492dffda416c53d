"""The bucket layout of a weight update (plan, flatten, checksum, manifest): rollwise.types.bucket_layout, where
the model layer's flat checkpoints (rollwise.model.flat_format) can use it too; re-exported here for the
transports."""

from rollwise.types.bucket_layout import (
    MIB,
    bucket_checksum,
    build_manifest,
    flatten_bucket,
    parse_manifest,
    plan_buckets,
    unflatten_bucket,
)

__all__ = ["MIB", "bucket_checksum", "build_manifest", "flatten_bucket", "parse_manifest", "plan_buckets",
           "unflatten_bucket"]
