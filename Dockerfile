# quota-proxy: one quota for the whole worker fleet.
#
#   docker build -t quota-proxy .
#   docker run --rm -p 8080:8080 -p 9090:9090 quota-proxy
#   docker run --rm -p 8080:8080 -p 9090:9090 -v $PWD/my-policy.yaml:/etc/quota-proxy/policy.yaml:ro quota-proxy
#
# The baked-in policy is config/example.yaml listening on 0.0.0.0 (8080 for workers,
# 9090 for /metrics /healthz /readyz /status); mount your own over
# /etc/quota-proxy/policy.yaml, and point it at Redis (store.url, or QUOTA_PROXY_STORE)
# when more than one replica runs. SIGTERM drains in-flight requests for at most the
# policy's drain_timeout (10s by default): give the container a longer stop grace period
# than that (docker stop -t 15, Kubernetes terminationGracePeriodSeconds: 15).
#
# --workers auto: one worker process per CPU the container may use (its CPU limit, e.g.
# docker run --cpus 2), all serving port 8080, with one admin port. On memory:// (the
# baked-in example) auto means one process: its buckets cannot be shared.

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 quota-proxy \
    && useradd --system --uid 10001 --gid quota-proxy --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin quota-proxy

# The libraries exactly as uv.lock pins them, checked against its hashes (the versions the
# tests ran on), then the package itself without resolving anything again: a real
# (non-editable) install, whose wheel carries the Lua scripts as proxy/lua. uv, pinned by
# hash, only exports the lock and leaves.
WORKDIR /tmp/quota-proxy-src
COPY scripts/uv-requirements.txt scripts/
COPY pyproject.toml uv.lock README.md ./
COPY proxy/ proxy/
COPY lua/ lua/
RUN pip install -r scripts/uv-requirements.txt \
    && uv export --frozen --no-dev --no-emit-project --output-file requirements.txt \
    && pip install --require-hashes --no-deps -r requirements.txt \
    && pip install --no-deps . \
    && pip uninstall -y uv \
    && cd / \
    && rm -rf /tmp/quota-proxy-src

# The example policies, and the default one made to listen on every interface.
# `quota-proxy check` fails the build if the policy does not validate.
COPY config/ /etc/quota-proxy/examples/
RUN sed -e 's/^listen: 127\.0\.0\.1:/listen: 0.0.0.0:/' \
        -e 's/^admin_listen: 127\.0\.0\.1:/admin_listen: 0.0.0.0:/' \
        /etc/quota-proxy/examples/example.yaml > /etc/quota-proxy/policy.yaml \
    && grep -q '^listen: 0\.0\.0\.0:8080' /etc/quota-proxy/policy.yaml \
    && grep -q '^admin_listen: 0\.0\.0\.0:9090' /etc/quota-proxy/policy.yaml \
    && quota-proxy check -c /etc/quota-proxy/policy.yaml

WORKDIR /
USER quota-proxy

EXPOSE 8080 9090
STOPSIGNAL SIGTERM

# No curl in the slim image: ask the admin listener with Python itself.
# QUOTA_PROXY_HEALTHCHECK_URL overrides the URL for a policy with another admin_listen.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; url = os.environ.get('QUOTA_PROXY_HEALTHCHECK_URL', 'http://127.0.0.1:9090/healthz'); opener = urllib.request.build_opener(urllib.request.ProxyHandler({})); sys.exit(0 if opener.open(url, timeout=2).status == 200 else 1)"]

CMD ["quota-proxy", "run", "--workers", "auto", "-c", "/etc/quota-proxy/policy.yaml"]
