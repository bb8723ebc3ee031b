#!/usr/bin/env bash
# Issue 23's crash count: `rewind bench agentic --servers rewind --sessions 3 --turns 8` N times
# in a row (default 20); a run counts as clean when the bench exits 0 with every turn answered
# and the kernel logged no segfault of a Python process meanwhile. Writes a Markdown summary.
#   bash scripts/crash_runs.sh [N] [OUT.md] [extra bench arguments...]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-20}"; out="${2:-$root/benchmarks/results/native-safety/agentic-crash-runs.md}"
shift $(( $# < 2 ? $# : 2 ))
work="$(mktemp -d)"
segfaults() { dmesg 2>/dev/null | grep -c "python.*segfault" || true; }
{
  echo "# \`rewind bench agentic --servers rewind --sessions 3 --turns 8\` x $runs"
  echo
  echo "Code $(git -C "$root" rev-parse --short HEAD), $(date -u '+%F %H:%M') UTC, $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores."
  echo "ISA flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o 'avx2\|avx512[a-z_0-9]*\|amx[a-z_0-9]*' | sort -u | tr '\n' ' ')"
  echo "Extra bench arguments: ${*:-none}"
  echo
  echo "| run | bench exit | turns answered | python segfaults logged | wall s |"
  echo "| --- | --- | --- | --- | --- |"
} > "$out"
clean=0
for i in $(seq 1 "$runs"); do
  before=$(segfaults); started=$(date +%s)
  "$root/.venv/bin/rewind" bench agentic --servers rewind --sessions 3 --turns 8 --repeats 1 \
      --out "$work/run$i" "$@" > "$work/run$i.log" 2>&1
  code=$?
  turns=$("$root/.venv/bin/python" -c "import json,sys; d=json.load(open(sys.argv[1])); print(sum(1 for r in d['records'] if r.get('turn',-1)>=0 and r.get('finish_reason')))" "$work/run$i/agentic.json" 2>/dev/null || echo 0)
  after=$(segfaults)
  [ "$code" = 0 ] && [ "$turns" -ge 24 ] && [ "$after" = "$before" ] && clean=$((clean + 1))
  echo "| $i | $code | $turns | $((after - before)) | $(( $(date +%s) - started )) |" >> "$out"
  echo "run $i: exit $code, $turns turns, segfaults $((after - before))"
done
echo >> "$out"
echo "Clean runs: $clean of $runs." >> "$out"
echo "clean $clean of $runs"
