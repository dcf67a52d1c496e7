#!/usr/bin/env bash
# Resolve docker/requirements.in into docker/requirements.lock: exact versions and sha256 hashes for the
# image's platform (linux x86_64, Python 3.11), whatever machine runs this. Needs `uv` (pip install uv).
set -euo pipefail
cd "$(dirname "$0")"
uv pip compile requirements.in --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --generate-hashes --no-header -o requirements.lock
