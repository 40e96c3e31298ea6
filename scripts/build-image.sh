#!/usr/bin/env bash
# Build the Dockerfile and tag it as the chart's default image (helm/pdcoord: image.repository,
# tag = image.tag or the chart's appVersion), with docker, podman or buildah, whichever works.
#
# Usage: scripts/build-image.sh            build and tag
#        scripts/build-image.sh --ref      print the image reference only
#        scripts/build-image.sh --tool     print the container tool that would be used (exit 1: none)
#
# Environment: CONTAINER_TOOL=docker|podman|buildah forces a tool; PDCOORD_IMAGE_BASE=registry|local
# forces where the base image comes from (default: the registry when it answers, else local).
#
# The normal path is `<tool> build .` with the Dockerfile's python:3.11-slim base from Docker Hub.
# Fallbacks for hosts without a reachable registry (podman/buildah only), kept here and out of the
# Dockerfile:
#   - local base: a Debian bookworm rootfs (debootstrap, python3 + venv) imported as an image and
#     passed with `--from`, cached under .cache/image/;
#   - wheelhouse: the dependencies are downloaded on the host (its pip configuration and CA bundle)
#     into .cache/image/wheels and mounted into the build at /wheels;
#   - podman on hosts where crun cannot run (cgroup v1/hybrid) or root cannot raise RLIMIT_NOFILE to
#     podman's default: a containers.conf drop-in selecting runc and the host's own nofile limit.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"
cache="${repo_root}/.cache/image"
base_local="localhost/pdcoord-base:bookworm"
debian_mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

# The chart's default reference, read the same way the chart renders it ("pdcoord.image").
image_ref() {
    local values="helm/pdcoord/values.yaml" repo tag
    # First `repository:` and `tag:` under the top-level `image:` block.
    repo="$(awk '/^image:/{f=1;next} f&&/^[^ #]/{f=0} f&&/^  repository:/{print $2; exit}' "${values}")"
    tag="$(awk '/^image:/{f=1;next} f&&/^[^ #]/{f=0} f&&/^  tag:/{print $2; exit}' "${values}" | tr -d '"')"
    if [[ -z "${tag}" ]]; then
        tag="$(awk '/^appVersion:/{print $2; exit}' helm/pdcoord/Chart.yaml | tr -d '"')"
    fi
    [[ -n "${repo}" && -n "${tag}" ]] || { echo "cannot read image.repository/tag from ${values}" >&2; exit 1; }
    echo "${repo}:${tag}"
}

pick_tool() {
    if [[ -n "${CONTAINER_TOOL:-}" ]]; then
        command -v "${CONTAINER_TOOL}" >/dev/null && { echo "${CONTAINER_TOOL}"; return 0; }
        echo "CONTAINER_TOOL=${CONTAINER_TOOL} is not installed" >&2
        return 1
    fi
    # A docker client without a reachable daemon does not count.
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        echo docker
    elif command -v podman >/dev/null; then
        echo podman
    elif command -v buildah >/dev/null; then
        echo buildah
    else
        return 1
    fi
}

# Workaround for VMs like the CI machines (not needed on an ordinary host): podman's default OCI
# runtime crun fails on cgroup v1/hybrid hosts, and podman asks for RLIMIT_NOFILE 1048576, which root
# cannot set where the hard limit is lower. A containers.conf drop-in selects runc and the host's own
# limits. Written only when those conditions hold.
podman_workaround() {
    local conf_dir=/etc/containers/containers.conf.d conf hard_nofile hard_nproc runtime="" needed=0
    conf="${conf_dir}/50-pdcoord-host-workaround.conf"
    hard_nofile="$(ulimit -Hn)"
    hard_nproc="$(ulimit -Hu)"
    # Measured on these VMs: runc fails to set RLIMIT_NPROC above kernel.pid_max even below the hard limit.
    local pid_max
    pid_max="$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)"
    if [[ "${hard_nproc}" == unlimited || "${hard_nproc}" -gt "${pid_max}" ]]; then
        hard_nproc="${pid_max}"
    fi
    if [[ ! -f /sys/fs/cgroup/cgroup.controllers ]] && command -v runc >/dev/null; then
        runtime=runc
        needed=1
    fi
    if [[ "${hard_nofile}" != unlimited && "${hard_nofile}" -lt 1048576 ]]; then
        needed=1
    fi
    [[ "${needed}" == 1 ]] || return 0
    if [[ "$(id -u)" != 0 ]]; then
        echo "warning: podman may need runc and lower default ulimits on this host; see ${BASH_SOURCE[0]}" >&2
        return 0
    fi
    echo "podman workaround: writing ${conf} (runtime=${runtime:-default}, nofile=${hard_nofile})" >&2
    mkdir -p "${conf_dir}"
    {
        echo "# Written by pdcoord's scripts/build-image.sh: this host runs cgroup v1/hybrid and/or limits"
        echo "# RLIMIT_NOFILE below podman's default, which root here cannot raise."
        echo "[containers]"
        echo "default_ulimits = [\"nofile=${hard_nofile}:${hard_nofile}\", \"nproc=${hard_nproc}:${hard_nproc}\"]"
        if [[ -n "${runtime}" ]]; then
            echo "[engine]"
            echo "runtime = \"${runtime}\""
        fi
    } >"${conf}"
}

# A Debian bookworm base with python3 and venv, from the Debian mirror, imported once and cached.
build_local_base() {
    local tool="$1" rootfs="${cache}/rootfs" tarball="${cache}/base-bookworm.tar"
    if "${tool}" image exists "${base_local}" 2>/dev/null; then
        return 0
    fi
    if [[ ! -f "${tarball}" ]]; then
        command -v debootstrap >/dev/null || {
            echo "no registry reachable and no debootstrap to build a local base (apt-get install debootstrap)" >&2
            exit 1
        }
        [[ "$(id -u)" == 0 ]] || { echo "debootstrap needs root" >&2; exit 1; }
        echo "building a local Debian bookworm base with debootstrap (about a minute) ..." >&2
        rm -rf "${rootfs}"
        mkdir -p "${cache}"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "${rootfs}" "${debian_mirror}" >"${cache}/debootstrap.log" 2>&1 || {
            tail -20 "${cache}/debootstrap.log" >&2
            exit 1
        }
        # Slim it like the official images: no apt lists, docs or locales.
        rm -rf "${rootfs}"/var/lib/apt/lists/* "${rootfs}"/var/cache/apt/*.bin \
            "${rootfs}"/usr/share/doc/* "${rootfs}"/usr/share/man/* "${rootfs}"/usr/share/locale/*
        tar -C "${rootfs}" -cf "${tarball}.tmp" . && mv "${tarball}.tmp" "${tarball}"
        rm -rf "${rootfs}"
    fi
    "${tool}" import --change 'CMD ["/bin/bash"]' "${tarball}" "${base_local}" >/dev/null
}

# The project's wheel and its dependencies' wheels, fetched through the host's pip configuration.
build_wheelhouse() {
    local python="${repo_root}/.venv/bin/python"
    [[ -x "${python}" ]] || python="$(command -v python3)"
    rm -rf "${cache}/wheels"
    mkdir -p "${cache}/wheels"
    "${python}" -m pip wheel --quiet --wheel-dir "${cache}/wheels" "${repo_root}" >&2
}

registry_reachable() {
    local tool="$1" ref
    ref="$(awk -F= '/^ARG PYTHON_IMAGE=/{print $2; exit}' Dockerfile)"
    "${tool}" image exists "${ref}" 2>/dev/null && return 0
    timeout 120 "${tool}" pull -q "${ref}" >/dev/null 2>&1
}

main() {
    case "${1:-}" in
        --ref) image_ref; return 0 ;;
        --tool) pick_tool; return ;;
        "") ;;
        *) echo "usage: $0 [--ref|--tool]" >&2; exit 2 ;;
    esac
    local ref tool base="${PDCOORD_IMAGE_BASE:-auto}"
    ref="$(image_ref)"
    tool="$(pick_tool)" || {
        echo "no container tool: install docker, podman or buildah (Debian: apt-get install podman buildah runc)" >&2
        exit 1
    }
    local args=(--file Dockerfile --tag "${ref}")
    if [[ "${tool}" == docker ]]; then
        [[ "${base}" != local ]] || { echo "PDCOORD_IMAGE_BASE=local needs podman or buildah" >&2; exit 1; }
        docker build "${args[@]}" .
    else
        [[ "${tool}" == podman ]] && podman_workaround
        if [[ "${base}" == auto ]]; then
            if registry_reachable "${tool}"; then base=registry; else base=local; fi
        fi
        if [[ "${base}" == local ]]; then
            echo "the registry is not reachable: building on a local base and an offline wheelhouse" >&2
            build_local_base "${tool}"
            build_wheelhouse
            args+=(--from "${base_local}" --volume "${cache}/wheels:/wheels:ro")
        fi
        # Host network: the build's apt-get uses the host's resolver and proxy settings.
        if [[ "${tool}" == podman ]]; then
            podman build --network host --layers "${args[@]}" .
        else
            buildah bud --network host --layers "${args[@]}" .
        fi
    fi
    echo "built ${ref} with ${tool}"
}

main "$@"
