"""HTTPS through the proxy: the CONNECT front door, interception, blind tunnels."""
