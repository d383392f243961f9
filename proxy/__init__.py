"""quota-proxy: one quota for the whole fleet."""

__version__ = "0.2.0"
