#!/usr/bin/env bash
# The candidate step of examples/ci-gate.yml, kept here so that it can be tested (tests/test_ci_gate_script.py)
# and run by hand. It stores the candidate run under one name per commit ($CANDIDATE_NAME), and on a
# rerun of the job it does not start again from nothing:
#
#   - that name's newest run is done (the job stopped later, in the gate or the promotion): nothing to run;
#   - it stopped mid-run (the job was cancelled or timed out: the run is `interrupted`; the runner was
#     lost: `abandoned` once its heartbeat is 10 minutes old; or it `failed`): finish it from its journal
#     with `evalkit run --resume RUN`, which computes only the batches the journal lacks. The journal
#     lives in the spool folder beside the DB (reports/evalkit.duckdb.spool/), which the workflow caches
#     with the DB; when it cannot resume (no journal, the run still looks alive), a new run starts;
#   - otherwise: a new run, `evalkit run $EVALKIT_RUN_ARGS --name $CANDIDATE_NAME`.
#
# Environment: EVALKIT_DB (the DB), CANDIDATE_NAME (default candidate), EVALKIT_RUN_ARGS (the run's
# options; default: the firsttoken tasks, 100 prompts a task, the metrics the default gate rules read).
set -u

name="${CANDIDATE_NAME:-candidate}"
args="${EVALKIT_RUN_ARGS:---tasks firsttoken --limit 100 --metrics gate}"
db="${EVALKIT_DB:-reports/evalkit.duckdb}"

last=""
if [ -f "$db" ]; then  # the first workflow run has no DB yet
  # the name is evalkit's own (a commit hash): quoting it into SQL is safe; any error of evalkit stops here
  last=$(evalkit query --format csv \
    "SELECT id || ' ' || status FROM runs WHERE name = '$name' ORDER BY created_at DESC, id DESC LIMIT 1") || exit $?
  last=$(tail -n +2 <<< "$last" | tr -d '\r')
fi
id="${last%% *}"
status="${last#* }"

case "$status" in
  done)
    echo "The candidate run $id ($name) is done already: nothing to run."
    exit 0 ;;
  interrupted|abandoned|failed|running)
    echo "The candidate run $id ($name) stopped ($status): finishing it from its journal."
    code=0
    evalkit run --resume "$id" || code=$?
    if [ "$code" -ne 2 ]; then exit "$code"; fi  # resumed (0), or failed at run time: the job says so
    echo "::warning::could not resume $id (see above): running the candidate again"
    ;;
esac
# shellcheck disable=SC2086  # the options are words
exec evalkit run $args --name "$name"
