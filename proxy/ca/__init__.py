"""The proxy's own certificate authority, for TLS interception (SPEC §8).

- ``authority``: ``CertificateAuthority`` loaded from PEM files and checked to be able
  to sign usable leaves (``CAError`` names the file and the problem), and whether its
  name constraints permit a host (``outside`` says which constraint a host is outside).
- ``leaves``: ``LeafMinter``, the hot path: a server-side ``ssl.SSLContext`` per
  intercepted host, its leaf signed by the CA, cached.
- ``commands``: what ``quota-proxy ca init`` and ``ca show`` do (create a CA, tell
  people how to trust it, describe it); the running proxy never imports it.

Name constraints: a CA made with ``permitted_hosts`` (``ca init --permit`` and ``-c``:
domain suffixes, hosts, addresses, networks) carries a critical NameConstraints
extension, so even a stolen ``ca-key.pem`` cannot vouch for other hosts. OpenSSL-based
clients enforce it on the trust anchor itself: Python's ``ssl`` (and so requests, httpx,
aiohttp, urllib), curl, Node.js (all checked). Java's default
trust manager ignores a trust anchor's constraints (checked on OpenJDK 17); other
stacks vary. The constraints only limit what the CA *could* sign: the proxy itself
only ever mints leaves for permitted hosts (``LeafMinter`` refuses others).
"""
