"""Migrations m001-m010: the tables, the views, the DB's identity and liveness (the first schema).

Applied in `MIGRATIONS` order (the package's `__init__`); never edited once applied."""

from __future__ import annotations

import duckdb


def m001_create_runs(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        """
        CREATE TABLE runs (
            id VARCHAR PRIMARY KEY,
            created_at TIMESTAMP NOT NULL,
            finished_at TIMESTAMP,
            status VARCHAR NOT NULL,          -- running / done / failed / interrupted
            name VARCHAR,
            model VARCHAR NOT NULL,           -- lm-eval model type as asked (hf, vllm, ...)
            model_args VARCHAR,               -- JSON object
            model_fingerprint VARCHAR,        -- sha256 of the weights file, or the revision
            dtype VARCHAR,
            quant VARCHAR,
            template VARCHAR,
            template_text VARCHAR,            -- JSON of the template definition
            system_prompt VARCHAR,
            tasks VARCHAR[],
            seed INTEGER,
            batch_size INTEGER,
            sample_limit INTEGER,
            top_k INTEGER,
            first_temperature DOUBLE,
            ban_openers BOOLEAN,
            opener_lexicon_version VARCHAR,
            evalkit_version VARCHAR,
            lm_eval_version VARCHAR,
            transformers_version VARCHAR,
            torch_version VARCHAR,
            git_commit VARCHAR,
            host VARCHAR,
            duration_s DOUBLE,
            config VARCHAR,                   -- JSON of the whole run configuration
            error VARCHAR
        )
        """
    )


def m002_create_metrics(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        """
        CREATE TABLE metrics (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            metric VARCHAR NOT NULL,
            filter VARCHAR NOT NULL,
            value DOUBLE,
            stderr DOUBLE,
            n INTEGER
        )
        """
    )


def m003_create_samples(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        """
        CREATE TABLE samples (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            prompt_hash VARCHAR,
            prompt VARCHAR,                   -- the exact context the model saw
            target VARCHAR,                   -- JSON list of accepted starts / keys
            response VARCHAR,
            first_token VARCHAR,
            first_token_id INTEGER,
            first_unit VARCHAR,
            ft_outcome VARCHAR,               -- hit / opener / other
            lang VARCHAR,
            category VARCHAR,
            ft_hit DOUBLE,
            ft_token_hit DOUBLE,
            ft_hit_prob DOUBLE,
            opener_rate DOUBLE,
            opener_mass DOUBLE,
            prior_drift DOUBLE,
            top3_mass DOUBLE,
            top3_share DOUBLE,
            unstable DOUBLE,
            entropy DOUBLE,
            needle_depth DOUBLE,
            needle_length INTEGER,
            needle_tokens INTEGER,
            needle_hint BOOLEAN,
            needle_recall DOUBLE,
            metrics VARCHAR                   -- JSON: every per-sample metric value
        )
        """
    )


def m004_create_first_token_topk(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        """
        CREATE TABLE first_token_topk (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            rank INTEGER NOT NULL,            -- 0 = most likely
            token_id INTEGER NOT NULL,
            token VARCHAR,
            logprob DOUBLE NOT NULL
        )
        """
    )


def m005_create_tags(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        """
        CREATE TABLE tags (
            tag VARCHAR NOT NULL,
            run_id VARCHAR NOT NULL,
            created_at TIMESTAMP NOT NULL
        )
        """
    )


def m006_create_views(con: duckdb.DuckDBPyConnection) -> None:
    # One row per finished run and metric, with the run dimensions beside it.
    con.execute(
        """
        CREATE VIEW leaderboard AS
        SELECT r.id AS run_id, r.name, r.model, r.model_fingerprint, r.quant, r.template,
               r.first_temperature, r.ban_openers, r.created_at,
               m.task, m.metric, m.value, m.stderr, m.n,
               m.value - 1.96 * m.stderr AS ci_lo, m.value + 1.96 * m.stderr AS ci_hi
        FROM runs r JOIN metrics m ON m.run_id = r.id
        WHERE r.status = 'done'
        """
    )
    # Needle recall per run, language, hint flag, depth and requested length.
    con.execute(
        """
        CREATE VIEW needle_heatmap AS
        SELECT run_id, lang, needle_hint AS hint, needle_depth AS depth,
               needle_length AS length, avg(needle_recall) AS recall,
               avg(needle_tokens) AS mean_tokens, count(*) AS n
        FROM samples
        WHERE needle_depth IS NOT NULL
        GROUP BY ALL
        """
    )
    # Per shared prompt of every pair of runs: top-1 flip and top-5 overlap (docs/metrics.md §1.5).
    con.execute(
        """
        CREATE VIEW first_token_drift AS
        WITH top AS (
            SELECT run_id, task, doc_id,
                   list(token_id ORDER BY rank) FILTER (WHERE rank < 5) AS top5,
                   sum(exp(logprob)) FILTER (WHERE rank < 5) AS top5_mass,
                   min_by(token_id, rank) AS top1
            FROM first_token_topk
            GROUP BY run_id, task, doc_id
        )
        SELECT a.run_id AS run_a, b.run_id AS run_b, a.task, a.doc_id,
               a.top5_mass AS top5_mass_a, b.top5_mass AS top5_mass_b,
               len(list_intersect(a.top5, b.top5)) / 5.0 AS top5_overlap,
               CAST(a.top1 <> b.top1 AS INTEGER) AS flipped
        FROM top a JOIN top b
          ON a.task = b.task AND a.doc_id = b.doc_id AND a.run_id <> b.run_id
        """
    )


def m007_create_run_drift_view(con: duckdb.DuckDBPyConnection) -> None:
    # first_token_drift aggregated per ordered pair of runs and task (docs/metrics.md §1.5): shared
    # prompts with top-k in both, mean top-5 overlap, share of flipped top-1 tokens,
    # and each run's mean top-5 mass. JSD needs the full top-k: see `evalkit compare`.
    con.execute(
        """
        CREATE VIEW run_drift AS
        SELECT run_a, run_b, task, count(*) AS n,
               avg(top5_overlap) AS top5_overlap,
               avg(flipped) AS flip_rate,
               avg(top5_mass_a) AS top5_mass_a,
               avg(top5_mass_b) AS top5_mass_b
        FROM first_token_drift
        GROUP BY run_a, run_b, task
        """
    )


APPLICATION_ID = "evalkit"  # evalkit_meta's application_id: this file is an evalkit DB


def m008_create_meta(con: duckdb.DuckDBPyConnection) -> None:
    # Marks the file as evalkit's, so that another program's DuckDB file is never mistaken
    # for one (and never migrated) because it happens to have a schema_version table.
    con.execute("CREATE TABLE evalkit_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)")
    con.execute("INSERT INTO evalkit_meta VALUES ('application_id', ?)", [APPLICATION_ID])


def m009_run_liveness(con: duckdb.DuckDBPyConnection) -> None:
    # Who runs a `running` run, so a reader can tell when its process is gone (abandoned):
    # the pid and its start time on `host` (the start time tells a reused pid apart), and
    # a heartbeat the run refreshes while it works.
    con.execute("ALTER TABLE runs ADD COLUMN pid INTEGER")
    con.execute("ALTER TABLE runs ADD COLUMN pid_start VARCHAR")
    con.execute("ALTER TABLE runs ADD COLUMN heartbeat_at TIMESTAMP")


def m010_metric_intervals(con: duckdb.DuckDBPyConnection) -> None:
    # A 95 % interval per aggregate that stays inside the metric's range (Wilson for
    # proportions, bootstrap percentile for bounded means), computed from the per-prompt
    # values when the run is stored; the leaderboard shows it, and value ± 1.96 stderr only
    # for rows stored before evalkit kept intervals.
    con.execute("ALTER TABLE metrics ADD COLUMN ci_lo DOUBLE")
    con.execute("ALTER TABLE metrics ADD COLUMN ci_hi DOUBLE")
    con.execute("DROP VIEW leaderboard")
    con.execute(
        """
        CREATE VIEW leaderboard AS
        SELECT r.id AS run_id, r.name, r.model, r.model_fingerprint, r.quant, r.template,
               r.first_temperature, r.ban_openers, r.created_at,
               m.task, m.metric, m.value, m.stderr, m.n,
               coalesce(m.ci_lo, m.value - 1.96 * m.stderr) AS ci_lo,
               coalesce(m.ci_hi, m.value + 1.96 * m.stderr) AS ci_hi
        FROM runs r JOIN metrics m ON m.run_id = r.id
        WHERE r.status = 'done'
        """
    )


# this module's migrations in the order they are applied (the package's MIGRATIONS joins the modules')
MIGRATIONS = (
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
