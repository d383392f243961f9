"""Quota beyond the buckets: concurrency caps, endpoint classes, tenancy, tenant seats."""
