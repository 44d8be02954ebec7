"""The append-only list of schema migrations of the evalkit DuckDB file.

Owns: the schema, as a list of named functions applied in order, each recorded
in `schema_version` inside the same transaction. Never edit or reorder an
applied migration; append a new one (to the newest `vNNN_MMM` module, and to
`MIGRATIONS` below). The functions live ten to a module by number. Does not:
open files or retry locks (that is `store.db.open_writer`).
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

from evalkit.store.migrations.v001_010 import (
    APPLICATION_ID,
    m001_create_runs,
    m002_create_metrics,
    m003_create_samples,
    m004_create_first_token_topk,
    m005_create_tags,
    m006_create_views,
    m007_create_run_drift_view,
    m008_create_meta,
    m009_run_liveness,
    m010_metric_intervals,
)
from evalkit.store.migrations.v011_020 import (
    m011_run_model_name,
    m012_answers_and_lead_indicators,
    m013_kv_cache,
    m014_quant_detail,
    m015_attention_and_conflict,
    m016_topk_units,
    m017_db_identity,
    m019_drift_by_position,
    m018_engine,
    m020_answer_prob,
)
from evalkit.store.migrations.v021_030 import (
    m021_tokenizer_identity,
    m022_no_interval_from_few_prompts,
    m023_tag_history,
    m024_gates,
    m025_run_caps,
    m026_metric_selection,
)

Migration = Callable[[duckdb.DuckDBPyConnection], None]

__all__ = ["APPLICATION_ID", "MIGRATIONS", "Migration"]

MIGRATIONS: list[Migration] = [
    m001_create_runs,
    m002_create_metrics,
    m003_create_samples,
    m004_create_first_token_topk,
    m005_create_tags,
    m006_create_views,
    m007_create_run_drift_view,
    m008_create_meta,
    m009_run_liveness,
    m010_metric_intervals,
    m011_run_model_name,
    m012_answers_and_lead_indicators,
    m013_kv_cache,
    m016_topk_units,
    # applied after m016: the list is the order of application and each entry's place its
    # schema_version number, so a migration is appended even when its name's number is lower
    m014_quant_detail,
    m015_attention_and_conflict,
    m017_db_identity,
    m019_drift_by_position,
    m018_engine,  # after m019: appended in the order it was written
    m020_answer_prob,
    m021_tokenizer_identity,
    m022_no_interval_from_few_prompts,
    m023_tag_history,
    m024_gates,
    m025_run_caps,
    m026_metric_selection,
]
