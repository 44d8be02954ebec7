"""The metric registry is the single source: the task YAMLs, the samples table, the gate,
the report and `evalkit metrics` all agree with it."""

from __future__ import annotations

import json

import duckdb
import pytest
import yaml
from click.testing import CliRunner

from evalkit.cli import cli
from evalkit.prompts.catalog import tasks_path
from evalkit.release.decide import RunData, decide
from evalkit.release.rules import Regression, Rules
from evalkit.scoring import registry
from evalkit.store.db import migrate


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _yaml_metric_lists():
    """(file, metric name, higher_is_better or None) of every metric_list / aggregate_metric_list entry."""
    out = []
    for path in sorted(tasks_path().rglob("*.yaml")):
        cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader) or {}
        for key in ("metric_list", "aggregate_metric_list"):
            for entry in cfg.get(key) or []:
                out.append((path.name, entry["metric"], entry.get("higher_is_better")))
    return out


def test_every_task_yaml_metric_is_registered_with_the_same_direction():
    entries = _yaml_metric_lists()
    assert len(entries) >= 12
    for name, metric, higher in entries:
        spec = registry.get(metric)
        assert spec is not None, f"{name}: {metric} is not in the registry"
        if higher is not None:
            assert spec.higher_is_better is higher, f"{name}: {metric} direction differs from the registry"


def test_every_per_sample_metric_is_a_samples_column():
    con = duckdb.connect(":memory:")
    migrate(con)
    columns = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = 'samples'").fetchall()}
    assert set(registry.per_sample_columns()) <= columns


def test_entries_are_complete_and_families_resolve():
    for m in registry.all_metrics():
        assert m.level in registry.LEVELS and m.meaning and m.unit
        assert m.hi is None or m.lo < m.hi
    assert registry.get("needle_recall@depth0.25").name == "needle_recall@depth{D}"
    assert registry.get("needle_recall@len4096").higher_is_better
    assert registry.get("needle_recall@") is None and registry.get("nope") is None
    assert registry.sort_key("needle_recall@depth0.5") < registry.sort_key("needle_recall@depth1") < registry.sort_key(
        "middle_gap") < registry.sort_key("unknown_metric")


def test_entropy_and_middle_gap_are_lower_is_better_in_the_gate():
    # the candidate's entropy rose on every prompt: a regression for a lower-is-better metric
    keys = [("t", str(i)) for i in range(30)]
    # (with some spread: the same rise on every prompt is a width-0 interval, which decides nothing)
    base = RunData("b", {}, {k: {"entropy": 1.0 + 0.01 * i} for i, k in enumerate(keys)})
    cand = RunData("c", {}, {k: {"entropy": 2.0 + 0.03 * i} for i, k in enumerate(keys)})
    verdict = decide(cand, base, Rules(regressions=(Regression("entropy", 0.1),)))
    assert not verdict.passed and verdict.rows[0].higher_is_better is False
    assert Rules().is_higher_better("t", "middle_gap") is False
    # and falling entropy passes
    assert decide(base, cand, Rules(regressions=(Regression("entropy", 0.1),))).passed


def test_metrics_command_lists_the_registry():
    result = CliRunner().invoke(cli, ["metrics", "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == [m.name for m in registry.all_metrics()]
    by_name = {r["name"]: r for r in rows}
    assert by_name["entropy"]["direction"] == "lower" and by_name["entropy"]["hi"] is None
    table = CliRunner().invoke(cli, ["metrics"], catch_exceptions=False).output
    assert "ft_hit_prob" in table and "↓ lower" in table and "needle_recall@depth{D}" in table
    assert by_name["ft_hit_prob"]["margin"] == "15 % of baseline" and by_name["entropy"]["margin"] is None


def test_metrics_margins_lists_each_default_margin_with_its_reason():
    out = CliRunner().invoke(cli, ["metrics", "--margins"], catch_exceptions=False).output
    lines = out.splitlines()[2:]
    assert {line.split()[0] for line in lines} == {m.name for m in registry.all_metrics() if m.margin}
    for m in registry.HEADLINE_METRICS:
        (line,) = [x for x in lines if x.split()[0] == m]
        assert f"{registry.margin(m)} *" in line and registry.margin(m).why[:40] in line


def test_every_metric_is_documented_for_users():
    """docs/metrics.md (its table, "At a glance", and its sections) names every registered metric;
    the README links to it and links no file outside the repository."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    docs = (root / "docs" / "metrics.md").read_text(encoding="utf-8")
    for m in registry.all_metrics():
        assert f"`{m.name}`" in docs or m.name in docs, f"docs/metrics.md lacks {m.name}"
    assert "(docs/metrics.md)" in readme
    assert "../" not in readme


def test_descriptive_metrics_have_no_direction_and_the_gate_asks_for_one():
    from evalkit.errors import BadInput
    from evalkit.release.decide import check_names
    from evalkit.release.rules import Threshold

    for name in ("sink_rate", "first_wins", "last_wins", "recency_index", "recency_index@len512"):
        spec = registry.get(name)
        assert spec.higher_is_better is None and spec.arrow == "–" and spec.to_dict()["direction"] == "none"
    assert registry.get("order_flip_rate").higher_is_better is False and registry.get("needle_attn").higher_is_better
    keys = [("needle_en", str(i)) for i in range(20)]
    base = RunData("b", {("needle_en", "sink_rate"): 0.8}, {k: {"sink_rate": 0.8} for k in keys})
    cand = RunData("c", {("needle_en", "sink_rate"): 0.5}, {k: {"sink_rate": 0.5} for k in keys})
    with pytest.raises(BadInput, match="sink_rate describes without ranking"):
        check_names(Rules(regressions=(Regression("sink_rate", 0.05),)), cand, base)
    # the rules file gives the direction: now a fall of sink_rate is a regression
    directed = Rules(regressions=(Regression("sink_rate", 0.05),), higher_is_better={"sink_rate": True})
    check_names(directed, cand, base)
    assert not decide(cand, base, directed).passed
    # a threshold needs no direction
    assert decide(cand, base, Rules(thresholds=(Threshold("sink_rate", ">=", 0.4),))).passed
