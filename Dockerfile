# The pdcoord image: pdmaster, nodeagent, pdsim and the pdcoord CLI on a slim Python, run as a
# non-root user under tini. `make image` (scripts/build-image.sh) builds it and tags the chart's
# default image; `docker build .` works unchanged wherever Docker Hub is reachable.
#
# Every stage derives from the first one, so `podman build --from IMAGE` (which replaces only the
# first FROM) swaps the base of the whole build: that is how scripts/build-image.sh uses a base made
# with debootstrap on hosts without a registry. The base must provide python3 with the venv module.
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

FROM base AS build
# tini-static is copied into the final stage, so apt and its lists stay here.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pdcoord
# LICENSE in /src: the installed package's metadata carries it (setuptools' default license-files).
COPY pyproject.toml README.md LICENSE /src/
COPY pdcoord /src/pdcoord
COPY pdmaster /src/pdmaster
COPY nodeagent /src/nodeagent
COPY pdsim /src/pdsim
# A wheelhouse mounted at /wheels (scripts/build-image.sh does so when the build cannot reach PyPI)
# is used offline; without one pip installs from the index. All dependencies ship binary wheels, so
# no compiler is needed.
RUN if ls /wheels/pdcoord-*.whl >/dev/null 2>&1; then \
        /opt/pdcoord/bin/pip install --no-index --find-links /wheels pdcoord; \
    else \
        /opt/pdcoord/bin/pip install /src; \
    fi \
    && /opt/pdcoord/bin/pip uninstall -y pip setuptools \
    && /opt/pdcoord/bin/pdmaster --help >/dev/null \
    && /opt/pdcoord/bin/nodeagent --help >/dev/null \
    && /opt/pdcoord/bin/pdsim --help >/dev/null \
    && /opt/pdcoord/bin/pdcoord --help >/dev/null

FROM base
# The uid/gid the chart's securityContext runs as (values.yaml podSecurityContext).
RUN groupadd --gid 10001 pdcoord \
    && useradd --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
        --shell /usr/sbin/nologin pdcoord
COPY --from=build /usr/bin/tini-static /usr/bin/tini
COPY --from=build /opt/pdcoord /opt/pdcoord
COPY LICENSE /usr/share/doc/pdcoord/LICENSE
ENV PATH=/opt/pdcoord/bin:$PATH
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 50051 8081 30000
# tini is PID 1: it forwards SIGTERM to the process group (-g) so pdmaster drains, and reaps zombies.
ENTRYPOINT ["/usr/bin/tini", "-g", "--"]
CMD ["pdmaster", "--help"]
