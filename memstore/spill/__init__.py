"""The durable tier: committed steps spilled to any fsspec URL (file://, s3://, ...)."""
