#!/usr/bin/env bash
# Tests for .ci/check-files in throwaway git repositories: what it must refuse, what the
# allow-list may let through, and what it may never let through. `make lint` runs it.
set -euo pipefail

script=$(cd "$(dirname "$0")" && pwd)/check-files
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0

# repo creates a fresh repository holding one text file and enters it.
repo() {
  rm -rf "$tmp/r" && mkdir -p "$tmp/r/.ci" && cd "$tmp/r"
  git init -q .
  echo 'package main' >main.go
  git add main.go
}

# expect runs check-files and compares its exit status (0 or 1) with the wanted one.
expect() {
  local want=$1 name=$2 got=0 out
  out=$("$script" 2>&1) || got=$?
  if [ "$got" -ne "$want" ]; then
    echo "FAIL $name: exit $got, want $want; output:"
    printf '%s\n' "$out" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}

repo
expect 0 "text files only"

repo
printf '\x7fELF\x02\x01\x01\x00\x00\x00' >tool && git add tool
expect 1 "ELF executable"
echo tool >.ci/allowed-files.txt && git add .ci/allowed-files.txt
expect 1 "ELF executable is refused even when allowed"

repo
printf 'MZ\x90\x00\x03\x00' >tool.exe && git add tool.exe
expect 1 "PE executable"

repo
printf '\xcf\xfa\xed\xfe\x07\x00\x00\x01' >tool-darwin && git add tool-darwin
expect 1 "Mach-O executable"

repo
printf 'PK\x03\x04\x00\x00data' >fixture.zip && git add fixture.zip
expect 1 "binary data file not allowed"
printf '# fixtures\nfixture.zip  # the reader test needs a real archive\n' >.ci/allowed-files.txt
git add .ci/allowed-files.txt
expect 0 "binary data file allowed"

repo
head -c 1048577 /dev/zero | tr '\0' 'a' >big.txt && git add big.txt
expect 1 "text file over 1 MiB"
echo big.txt >.ci/allowed-files.txt && git add .ci/allowed-files.txt
expect 0 "text file over 1 MiB allowed"

repo
head -c 1048576 /dev/zero | tr '\0' 'a' >limit.txt && git add limit.txt
expect 0 "text file of exactly 1 MiB"

repo
echo gone.bin >.ci/allowed-files.txt && git add .ci/allowed-files.txt
expect 1 "allow-list names an untracked file"

repo
printf '\x7fELF\x02' >tool && git add tool && rm tool
expect 1 "the index is checked, not the work tree"

if [ "$failures" -gt 0 ]; then
  echo "check-files_test: $failures failure(s)"
  exit 1
fi
echo "check-files_test: all passed"
