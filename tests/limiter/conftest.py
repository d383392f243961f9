"""The three-node Redis Cluster the limiter's tests share (started once per session)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.helpers.stores import LocalCluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        pytest.fail("redis-server and redis-cli are needed for the cluster tests; refusing to skip")
    cluster = LocalCluster(binary, cli, [tmp_path_factory.mktemp("cluster") for _ in range(3)])
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> Iterator[str]:
    """The session cluster's URL, every node emptied after the test."""
    yield redis_cluster.url
    redis_cluster.flush()
