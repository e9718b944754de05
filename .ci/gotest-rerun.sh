#!/usr/bin/env bash
# go test, and once more for the tests that failed: gotest-rerun.sh [go test flags] [packages].
#
# Run beside the others on a loaded two-core machine, a test that waits on timings (a lease, a
# poll, a 10 s read window) now and then fails where it passes alone. A failed top-level test is
# run again, whole and once, in its package; the pass fails unless every one of them passes
# then. Those that passed only on their second run are listed at the end under "FLAKY": each is
# a test to mend, not to ignore. A package that failed without naming a failed test (a build
# error, a panic, a timeout, which end its test binary before its other tests ran) is not run
# again, nor one whose output says "gotest-rerun: no rerun" (a test's word that its failure is
# not one of timing, such as a message lost): the pass fails.
#
# The flags are given once and used for both runs; -run is replaced on the second run only.
set -uo pipefail

flags=()
pkgs=()
for a in "$@"; do
  case "$a" in
    -*) flags+=("$a") ;;
    *)
      if [ "${#flags[@]}" -gt 0 ] && [[ "${flags[-1]}" =~ ^-(run|skip|timeout|p|count|parallel)$ ]]; then
        flags+=("$a")
      else
        pkgs+=("$a")
      fi
      ;;
  esac
done

log=$(mktemp)
trap 'rm -f "$log"' EXIT
go test "${flags[@]}" "${pkgs[@]}" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] && exit 0

# The failed top-level tests of each failed package, "package test..." a line; a package whose
# binary ended early, or that names none, gets the word "-" and is not run again.
failed=$(awk '
  /^--- FAIL: / { names = names " " $3; next }
  /^panic: |^\*\*\* Test killed|^panic: test timed out/ { broken = 1 }
  /gotest-rerun: no rerun/ { broken = 1 }
  /^FAIL\t[^ \t]+/ || /^FAIL [^ \t]+/ {
    split($0, f, /[ \t]+/)
    if (f[2] != "" && f[2] !~ /^\[/) { print f[2], ((broken || names == "") ? "-" : names) }
    names = ""; broken = 0; next
  }
  /^ok  \t/ { names = ""; broken = 0 }
' "$log")

if [ -z "$failed" ] || grep -q ' -$' <<<"$failed"; then
  echo "gotest-rerun: a package failed without a test to run again (build error, panic, timeout, or a failure its test says is not one of timing): no second run"
  exit "$status"
fi

# The flags of the second run: every flag but -run and its pattern.
again=()
skip=0
for f in "${flags[@]}"; do
  if [ "$skip" -eq 1 ]; then skip=0; continue; fi
  case "$f" in
    -run) skip=1 ;;
    -run=*) ;;
    *) again+=("$f") ;;
  esac
done

flaky=()
status=0
while read -r pkg names; do
  pattern="^($(tr ' ' '|' <<<"$names"))\$"
  echo "=== gotest-rerun: $pkg: running again, alone: $names"
  out=$(go test "${again[@]}" -run "$pattern" "$pkg" 2>&1)
  rc=$?
  echo "$out"
  if [ "$rc" -eq 0 ] && ! grep -q 'no tests to run' <<<"$out"; then
    flaky+=("$pkg: $names")
  else
    status=1 # failed again, or the names matched no test: nothing was run again
  fi
done <<<"$failed"

for f in "${flaky[@]}"; do
  echo "FLAKY (failed beside the other tests, passed when run again): $f"
done
exit "$status"
