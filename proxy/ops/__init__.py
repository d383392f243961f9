"""Operating the proxy: the admin port and its live page, worker processes, reloads, sizing."""
