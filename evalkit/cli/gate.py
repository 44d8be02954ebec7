"""`evalkit gate` (may a candidate run replace the baseline?) and `evalkit promote RUN --tag NAME`."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option
from evalkit.kinds import ON_INCONCLUSIVE
from evalkit.textsafe import term_text


@click.command("gate")
@click.option("--candidate", required=True, help="The run to judge: id, unique prefix, latest, tag:NAME, or a run name.")
@click.option("--baseline", required=True, help="The run to compare against, e.g. tag:prod.")
@click.option("--rules", "rules_file", metavar="same|upgrade|FILE", default=None,
              help="The question the gate answers: 'same' (the same model, cheaper: quality no worse and the "
                   "first-token distribution unchanged; the default), 'upgrade' (no worse: quality only), or a YAML "
                   "rules file (thresholds, regressions; 'extends: same|upgrade' builds on a set).")
@click.option("--junit", "junit_file", type=click.Path(dir_okay=False), default=None,
              help="Also write the verdict as JUnit XML to this file.")
@click.option("--on-inconclusive", type=click.Choice(ON_INCONCLUSIVE), default=None,
              help="Exit as a pass (0) or a fail (1) when the gate is inconclusive, instead of 3.")
@click.option("--no-record", is_flag=True,
              help="Do not keep the decision in the DB's `gates` table: the gate then only reads the DB.")
@db_option
def gate_command(candidate, baseline, rules_file, junit_file, on_inconclusive, no_record, db):
    """Gate a candidate run against a baseline: exit 0 pass, 1 fail, 2 bad input, 3 inconclusive.

    Each rule is a test with three outcomes. A regression passes when the 95 % interval
    of the candidate's drop (paired over the prompts both runs share) lies wholly below
    its margin, fails when it lies wholly above and survives Holm's correction, and is
    inconclusive in between; the row then says about how many prompts would decide it.
    Prints the verdict as a markdown table and appends it to $GITHUB_STEP_SUMMARY when
    that is set. Then keeps the decision in the DB (`gates`, `gate_checks`; `evalkit report`
    shows it): the only write, after the verdict, and never a migration; when it cannot be
    written the verdict and its exit code stand, with a warning. --no-record only reads the DB.
    See docs/gate.md.

    Two questions, two shipped rule sets: --rules same (the default) asks whether the
    candidate is the same model, cheaper (a quantization, a cast, a KV policy); --rules
    upgrade asks whether it is no worse (a new model, a fine-tune, another template).

    \b
    Examples:
      evalkit gate --candidate latest --baseline tag:prod
      evalkit gate --candidate new-model --baseline tag:prod --rules upgrade
      evalkit gate --candidate 2612021005 --baseline tag:prod --rules examples/gate-rules.yaml --junit gate.xml
      evalkit gate --candidate latest --baseline tag:prod --on-inconclusive fail
    """
    from evalkit import api, envvars
    from evalkit.errors import GateInconclusive, RunFailed
    from evalkit.paths import append_file, check_output_file, write_file
    from evalkit.store.db import db_path

    inputs = [db_path(db), rules_file]
    if junit_file:
        check_output_file(junit_file, "--junit", protect=inputs)
    summary = envvars.step_summary()
    if summary:
        check_output_file(summary, "$GITHUB_STEP_SUMMARY", protect=[*inputs, junit_file], append=True)
    result = api.gate(candidate, baseline, rules_file, db=db)
    click.echo(result.markdown, nl=False)
    if junit_file:
        write_file(junit_file, result.junit, "--junit")
    kept = "" if no_record else _record(db, result, baseline)  # the only write to the DB, after the verdict
    if summary:  # appended, never through a link: the runner owns the file and reads it back
        append_file(summary, result.markdown + kept + "\n", "$GITHUB_STEP_SUMMARY")
    if result.passed:
        return
    reasons = result.verdict.reasons
    more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
    if result.outcome == "fail":
        raise RunFailed(f"gate failed for candidate {result.candidate_id}: {reasons[0]}{more}")
    what = f"gate inconclusive for candidate {result.candidate_id}: {reasons[0]}{more}"
    if on_inconclusive == "pass":
        click.echo(term_text(f"evalkit: note: {what} (--on-inconclusive pass: exit 0)"), err=True)
        return
    if on_inconclusive == "fail":
        raise RunFailed(f"{what} (--on-inconclusive fail)")
    raise GateInconclusive(what)


def _record(db, result, baseline_ref: str) -> str:
    """Keep the decision in the DB; return the markdown line that says where (for the step
    summary), or "" when it could not be kept (a warning says why; the verdict stands)."""
    from evalkit.errors import EvalkitError
    from evalkit.release.db import record_decision

    try:
        gate_id = record_decision(db, result, baseline_ref)
    except EvalkitError as exc:
        click.echo(f"evalkit: warning: the decision was not recorded in the DB: {exc}", err=True)
        return ""
    click.echo(f"\nRecorded as gate {gate_id} (evalkit report: Promotions and gates).")
    # no link: a relative one is dead in GitHub's summary view, and where the report lands is the workflow's
    return (f"\nRecorded as gate `{gate_id}` in the DB: `evalkit report --out DIR` lists it in DIR/index.html "
            "under Promotions and gates (in CI, the report your workflow uploads as an artifact).\n")


@click.command("promote")
@click.argument("run")
@click.option("--tag", required=True, help="Tag name; `tag:NAME` then resolves to this run until the next promotion.")
@db_option
def promote_command(run, tag, db):
    """Make a finished run the tag's current run, e.g. the production baseline. RUN: id, prefix,
    latest, tag:NAME, or a run name. `tag:NAME` is the run promoted to NAME most recently, so
    promoting an earlier run again rolls the tag back; `evalkit tags` shows the history.

    \b
    Examples:
      evalkit promote latest --tag prod
      evalkit gate --candidate latest --baseline tag:prod && evalkit promote latest --tag prod
      evalkit promote 2612011200-abcdef --tag prod     # roll back to an earlier run
    """
    from evalkit.release.db import promote

    done = promote(db, run, tag)
    if not done.added:
        click.echo(term_text(f"run {done.run_id} already tagged {tag}"))
    elif done.previous is None:
        click.echo(term_text(f"run {done.run_id} tagged {tag}"))
    else:
        click.echo(term_text(f"run {done.run_id} tagged {tag} (was {done.previous})"))


COMMANDS = [gate_command, promote_command]
