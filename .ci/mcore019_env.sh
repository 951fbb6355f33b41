#!/usr/bin/env bash
# Creates (or reuses) the second CI environment: Python 3.12 + megatron-core 0.19 with the pins of
# requirements/constraints-py312-mcore019.txt. It lives outside the clone, under
# ${MEGATRON_VIDEO_CACHE:-~/.cache/megatron_video}/env-<hash of the pin files>, so a later clean
# clone with the same pins reuses it (the torch cp312 wheel is the ~0.5 GB CUDA build plus NVIDIA
# libraries). Prints the environment's python on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY312="${MEGATRON_VIDEO_PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}"
PINS=requirements/constraints-py312-mcore019.txt
KEY=$(cat "$PINS" requirements/requirements.txt | sha256sum | cut -c1-16)
CACHE="${MEGATRON_VIDEO_CACHE:-$HOME/.cache/megatron_video}"
ENV="$CACHE/env-py312-mcore019-$KEY"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock-$KEY"
flock 9  # one builder at a time: a second caller waits, then reuses the finished environment
if [ ! -f "$ENV/.complete" ]; then
    rm -rf "$ENV"
    "$PY312" -m venv "$ENV" >&2
    "$ENV/bin/python" -m pip install -q --disable-pip-version-check \
        -r requirements/requirements.txt -c "$PINS" >&2
    touch "$ENV/.complete"
fi
echo "$ENV/bin/python"
