"""The wire: HTTP/1.1 to workers and vendors, framing, connection limits, header rules."""
