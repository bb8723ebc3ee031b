#!/usr/bin/env bash
# Set up (idempotent) and start the Rewind server on the embedded default model (Gemma 3 270M,
# converted to MLX on first use). Extra arguments go to `rewind serve`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REWIND_EXTRAS="${REWIND_EXTRAS:-dev}" bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/rewind" serve --model default "$@"
