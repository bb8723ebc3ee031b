#!/usr/bin/env bash
# Install the coding agents the end-to-end tests drive (tests/test_agents_e2e.py), from the npm
# registry, into .agents/ of the repository (ignored by git):
#   Claude Code  @anthropic-ai/claude-code  -> .agents/node_modules/.bin/claude
#   codex        @openai/codex              -> .agents/node_modules/.bin/codex
# Versions are pinned below (override with CLAUDE_CODE_VERSION / CODEX_VERSION). Both packages
# bring a native x86-64 / arm64 binary as an optional dependency of the same registry (about
# 400 MB each), so Node.js is only needed for npm itself and codex's small launcher.
# Idempotent: when the pinned versions are installed and answer --version, nothing is done.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="$root/.agents"
claude_version="${CLAUDE_CODE_VERSION:-2.1.332}"
codex_version="${CODEX_VERSION:-0.171.0}"
bin="$dir/node_modules/.bin"
want="claude-code@$claude_version codex@$codex_version"

say() { printf '[install-agents] %s\n' "$*" >&2; }

installed() {
  [ -f "$dir/.installed" ] && [ "$(cat "$dir/.installed")" = "$want" ] || return 1
  "$bin/claude" --version 2>/dev/null | grep -qF "$claude_version" || return 1
  "$bin/codex" --version 2>/dev/null | grep -qF "$codex_version" || return 1
}

if installed; then
  say "already installed: $want in $bin"
  exit 0
fi

command -v npm >/dev/null 2>&1 || { say "npm is not installed (Node.js 18 or newer with npm is needed)"; exit 1; }
mkdir -p "$dir"
# Two test sessions at once: the second waits for the first one's install, then finds it done.
if command -v flock >/dev/null 2>&1; then
  exec 9>"$dir/.lock"
  if ! flock -n 9; then
    say "another install is running: waiting for it"
    flock 9
  fi
  if installed; then
    say "already installed: $want in $bin"
    exit 0
  fi
fi

rm -f "$dir/.installed"
cat > "$dir/package.json" <<EOF
{
  "name": "rewind-test-agents",
  "private": true,
  "description": "Coding agents for Rewind's end-to-end tests; installed by scripts/install-agents.sh",
  "dependencies": {
    "@anthropic-ai/claude-code": "$claude_version",
    "@openai/codex": "$codex_version"
  }
}
EOF

say "node $(node --version 2>/dev/null || echo '?'), npm $(npm --version), registry $(npm config get registry)"
say "installing $want into $dir (two native binaries, ~800 MB in all; about a minute)"
start=$SECONDS
# The packages ship their binaries as optional dependencies: keep them even where the user's npm
# config omits optional ones. Claude Code's package.json asks for Node 22 but runs its native
# binary, so an older Node only warns (engine-strict off).
# --loglevel=http shows each download as it completes; the whole log is kept for a failure.
set +e
npm install --prefix "$dir" --no-audit --no-fund --include=optional --engine-strict=false \
  --foreground-scripts --loglevel=http > "$dir/npm-install.log" 2>&1 &
npm_pid=$!
while kill -0 "$npm_pid" 2>/dev/null; do
  sleep 5
  say "... $((SECONDS - start)) s, $(du -sm "$dir/node_modules" 2>/dev/null | cut -f1) MB so far"
done
wait "$npm_pid"
npm_rc=$?
set -e
grep -E 'http fetch GET|postinstall|added|changed|up to date' "$dir/npm-install.log" >&2 || true
if [ "$npm_rc" != "0" ]; then
  say "npm install failed with exit code $npm_rc; its log ($dir/npm-install.log):"
  tail -n 60 "$dir/npm-install.log" >&2
  exit 1
fi
say "npm install done in $((SECONDS - start)) s"

# Claude Code's postinstall copies its platform binary over bin/claude.exe; an npm that does
# not run install scripts leaves a placeholder there: run the postinstall ourselves.
if ! "$bin/claude" --version >/dev/null 2>&1; then
  say "running Claude Code's postinstall (npm did not)"
  (cd "$dir/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2
fi

claude_said="$("$bin/claude" --version 2>&1)" || { say "claude does not run: $claude_said"; exit 1; }
codex_said="$("$bin/codex" --version 2>&1)" || { say "codex does not run: $codex_said"; exit 1; }
case "$claude_said" in *"$claude_version"*) ;; *) say "claude says '$claude_said', want $claude_version"; exit 1 ;; esac
case "$codex_said" in *"$codex_version"*) ;; *) say "codex says '$codex_said', want $codex_version"; exit 1 ;; esac
echo "$want" > "$dir/.installed"
say "ready: $claude_said; $codex_said (in $bin)"
