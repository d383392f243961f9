"""What the proxy tells: metrics, the access log, recent counts, rate-limited warnings."""
