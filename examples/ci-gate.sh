#!/usr/bin/env bash
# The gate step of examples/ci-gate.yml, kept here so that it can be tested (tests/test_ci_gate_script.py)
# and run by hand. It decides whether the candidate (the latest run in $EVALKIT_DB) may be promoted,
# and writes promote=true|false to $GITHUB_OUTPUT. It never promotes without a gate:
#
#   - no run tagged $EVALKIT_TAG (prod) in the DB: the job fails with one line, unless the user said
#     this is the first baseline (FIRST_BASELINE=true, the workflow_dispatch input `first_baseline`);
#     a history that was lost (an evicted cache, a deleted artifact) is never mistaken for a first run;
#   - gate exit 0: promote=true; 3 (inconclusive): a warning, promote=false, the job stays green;
#     1 (fail), 2 (bad input) or anything else: no promote output, and the job fails with that code.
#
# Environment: EVALKIT_DB (the DB the candidate was stored in), EVALKIT_TAG (default prod),
# EVALKIT_RULES (a rules file; unset or empty: the calibrated default rules), FIRST_BASELINE (true: allow a first
# baseline), GITHUB_OUTPUT, GITHUB_STEP_SUMMARY (optional: a line is appended to each).
set -u

tag="${EVALKIT_TAG:-prod}"
rules="${EVALKIT_RULES-}"
output="${GITHUB_OUTPUT:-/dev/null}"
summary="${GITHUB_STEP_SUMMARY:-/dev/null}"

decide() {  # promote=true|false, in the step's outputs; without it the promote step does not run
  echo "promote=$1" >> "$output"
}

fail() {  # one line on stderr (and in the job summary), then the exit code; nothing is promoted
  echo "ci-gate: error: $2" >&2
  echo "**evalkit gate: not run.** $2" >> "$summary"
  exit "$1"
}

# Is a run tagged $tag? Read from the tags table; any error of evalkit is an error here too.
tagged=$(evalkit query --format csv "SELECT count(*) AS n FROM tags WHERE tag = '$tag'" 2>&1) \
  || fail 2 "could not read the tags of ${EVALKIT_DB:-the DB}: $(tail -n 1 <<< "$tagged")"
count=$(tail -n 1 <<< "$tagged" | tr -d '[:space:]')
case "$count" in
  ''|*[!0-9]*) fail 2 "could not read the tags of ${EVALKIT_DB:-the DB}: got '$count'" ;;
esac

if [ "$count" = 0 ]; then
  if [ "${FIRST_BASELINE:-false}" = true ]; then
    echo "No run is tagged $tag, and this was declared the first baseline (first_baseline=true): the candidate is promoted without a gate." | tee -a "$summary"
    decide true
    exit 0
  fi
  fail 1 "no run is tagged $tag in ${EVALKIT_DB:-the DB}, so there is no baseline to gate against and nothing is promoted (was the run history lost? restore it, or rerun with first_baseline=true if this is the very first baseline)"
fi

code=0
if [ -n "$rules" ]; then
  evalkit gate --candidate latest --baseline "tag:$tag" --rules "$rules" --junit gate.xml || code=$?
else
  evalkit gate --candidate latest --baseline "tag:$tag" --junit gate.xml || code=$?
fi
case $code in
  0) decide true ;;
  3) echo "::warning::evalkit gate is inconclusive: not promoted (more prompts would decide it; see the job summary)"
     decide false ;;
  *) exit "$code" ;;
esac
