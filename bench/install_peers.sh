#!/usr/bin/env bash
# Install the peer wheels carried in .wheels/ (the device machine has no network).
# Offline and without dependencies; a wheel that fails to install is reported, not fatal;
# an empty or missing .wheels/ installs nothing.
#   bash bench/install_peers.sh            # PYTHON=python3.12 bash bench/install_peers.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
shopt -s nullglob
wheels=(.wheels/*.whl)
if ((${#wheels[@]} == 0)); then
  echo "install_peers: no wheels in .wheels/, nothing to install"
  exit 0
fi
for whl in "${wheels[@]}"; do
  if PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet --no-deps --no-index \
      --disable-pip-version-check "$whl"; then
    echo "install_peers: installed $(basename "$whl")"
  else
    echo "install_peers: FAILED $(basename "$whl") (the benchmark records that peer as missing)"
  fi
done
exit 0
