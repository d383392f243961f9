"""Developer tools shipped in the wheel but not on the proxy's request path.

- ``mockvendor``: a vendor API that enforces its own quota, the double the tests, the benchmarks
  and the demo serve; ``mockvendor_cli`` is ``quota-proxy mock-vendor``.
- ``demo``: two worker fleets under one quota, with and without the proxy; ``demo_cli`` is
  ``quota-proxy demo``.

Each ``*_cli`` module registers its own command and arguments (``register(commands)``, whose
``handler`` runs it) and stays light: the tool it runs is imported only when it runs.
"""
