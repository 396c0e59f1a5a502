#!/usr/bin/env bash
# The peers' own environment for side-by-side benchmarks: msprobe and TorchLens from PyPI, on top of
# the torch already installed (system site packages), never a runtime dependency of tracecmp.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
env="${PEER_ENV:-$here/.peerenv}"
[ -x "$env/bin/python" ] || python3 -m venv --system-site-packages "$env"
"$env/bin/pip" install -q mindstudio-probe==26.2.0 torchlens==2.36.1
echo "$env/bin/python"
