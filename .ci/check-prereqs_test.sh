#!/usr/bin/env bash
# Tests for .ci/check-prereqs with a PATH of stub binaries: it passes when everything is there,
# and otherwise fails with one line per missing tool. `make lint` runs it.
set -euo pipefail

script=$(cd "$(dirname "$0")" && pwd)/check-prereqs
bash_bin=$(command -v bash)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# tools creates a fresh bin folder holding stubs of the named tools (plus what the script
# itself runs) and points PATH at it alone. "go" reports GOVERSION $GOV (default go1.26.0).
tools() {
  rm -rf "$tmp/bin" && mkdir -p "$tmp/bin"
  ln -s "$(command -v id)" "$tmp/bin/id"
  local t
  for t in "$@"; do
    if [ "$t" = go ]; then
      printf '#!%s\necho "%s"\n' "$bash_bin" "${GOV:-go1.26.0}" >"$tmp/bin/go"
    else
      printf '#!%s\nexit 0\n' "$bash_bin" >"$tmp/bin/$t"
    fi
    chmod +x "$tmp/bin/$t"
  done
}

# expect runs check-prereqs and compares its exit status and the number of lines it printed.
expect() {
  local want=$1 lines=$2 name=$3 got=0 out n
  out=$(env -i PATH="$tmp/bin" HOME="$tmp" CHECK_PREREQS_PGLIB="$tmp/nopg" CHECK_PREREQS_SBIN="$tmp/nosbin" ${DB:+DATABASE_URL=$DB} \
    "$bash_bin" "$script" 2>&1) || got=$?
  n=$(printf '%s' "$out" | grep -c . || true)
  if [ "$got" -ne "$want" ] || [ "$n" -ne "$lines" ]; then
    echo "FAIL $name: exit $got, want $want; $n lines, want $lines; output:"
    printf '%s\n' "$out" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}

tools go initdb pg_ctl redis-server chromium pgbouncer
if [ "$(id -u)" -eq 0 ] && ! id postgres >/dev/null 2>&1; then
  expect 1 1 "root without a postgres user"
else
  expect 0 0 "everything installed"
fi

tools go initdb pg_ctl chromium pgbouncer
expect 1 1 "no redis-server"

tools go initdb pg_ctl redis-server pgbouncer
expect 1 1 "no chromium"

tools go initdb pg_ctl redis-server chromium-browser pgbouncer
expect 0 0 "chromium-browser instead of chromium"

tools go initdb pg_ctl redis-server chromium
expect 1 1 "no pgbouncer"

mkdir -p "$tmp/nosbin" && printf '#!%s\n' "$bash_bin" >"$tmp/nosbin/pgbouncer" && chmod +x "$tmp/nosbin/pgbouncer"
expect 0 0 "pgbouncer in /usr/sbin, not on PATH"
rm -rf "$tmp/nosbin"

tools go redis-server chromium pgbouncer
expect 1 2 "no PostgreSQL: one line each for initdb and pg_ctl"
DB=postgres://x/y expect 0 0 "no PostgreSQL binaries but DATABASE_URL set"

mkdir -p "$tmp/nopg/15/bin" && printf '#!%s\n' "$bash_bin" >"$tmp/nopg/15/bin/initdb" && cp "$tmp/nopg/15/bin/initdb" "$tmp/nopg/15/bin/pg_ctl"
expect 0 0 "PostgreSQL in the Debian library folder, not on PATH"
rm -rf "$tmp/nopg"

tools initdb pg_ctl redis-server chromium pgbouncer
expect 1 1 "no go"

GOV=go1.25.3 tools go initdb pg_ctl redis-server chromium pgbouncer
expect 1 1 "go too old"

tools
expect 1 6 "nothing installed"

if [ "$failures" -gt 0 ]; then
  echo "check-prereqs_test: $failures failed"
  exit 1
fi
