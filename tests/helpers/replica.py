"""A proxy replica in its own process, serving a policy file with vendor fields its YAML
cannot say yet.

``python -m tests.helpers.replica POLICY.yaml --concurrency N`` serves POLICY as
``quota-proxy run -c POLICY.yaml`` does (the same ``serve``, ready line and signals), with
every vendor's ``concurrency`` set to N (``dataclasses.replace``).
TODO(coordinator): once the loader reads ``concurrency:``, tests use ``cli("run", "-c", ...)``
with the YAML key and this module goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

from proxy.cli import _asyncio_run
from proxy.policy import load_policy
from proxy.server import serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replica")
    parser.add_argument("policy")
    parser.add_argument("--concurrency", type=int, required=True)
    args = parser.parse_args(argv)
    policy = load_policy(args.policy)
    vendors = tuple(dataclasses.replace(v, concurrency=args.concurrency) for v in policy.vendors)
    policy = dataclasses.replace(policy, vendors=vendors)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return _asyncio_run(serve(policy, policy.listen, policy.admin_listen))


if __name__ == "__main__":
    sys.exit(main())
