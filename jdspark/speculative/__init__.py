"""Speculation: token warping and sampling, exact verification (spec dspark.md §5)."""
