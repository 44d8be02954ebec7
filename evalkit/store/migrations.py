"""The append-only list of schema migrations of the evalkit DuckDB file.

Owns: the schema, as a list of named functions applied in order, each recorded
in `schema_version` inside the same transaction. Never edit or reorder an
applied migration; append a new one. Does not: open files or retry locks
(that is `store.db.open_writer`).
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

Migration = Callable[[duckdb.DuckDBPyConnection], None]


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


def m011_run_model_name(con: duckdb.DuckDBPyConnection) -> None:
    # The model's name as every command shows it (the embedded model's name, or the last part
    # of `pretrained`, with the GGUF file), beside the lm-eval model type in `model`.
    con.execute("ALTER TABLE runs ADD COLUMN model_name VARCHAR")


def m012_answers_and_lead_indicators(con: duckdb.DuckDBPyConnection) -> None:
    # Does the first token predict the answer? Per prompt: the longer greedy continuation of a
    # prompt with checkable answers, whether it holds one (answer_hit), whether the first token
    # and the answer disagree, and the most likely first token's probability; per run x task x
    # category x signal: the AUROC of the signal against answer_hit, with its bootstrap interval.
    for column, kind in (("top1_prob", "DOUBLE"), ("answer_hit", "DOUBLE"), ("ft_answer_mismatch", "DOUBLE"),
                         ("answer", "VARCHAR")):
        con.execute(f"ALTER TABLE samples ADD COLUMN {column} {kind}")
    con.execute(
        """
        CREATE TABLE lead_indicators (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            category VARCHAR NOT NULL,        -- '*': all of the task's checkable prompts
            signal VARCHAR NOT NULL,          -- a metric name, oriented by its direction
            auroc DOUBLE,                     -- NULL when undefined (see reason)
            ci_lo DOUBLE,
            ci_hi DOUBLE,
            n INTEGER,                        -- checkable prompts with a value of the signal
            n_right INTEGER,                  -- of them, answer_hit = 1
            base_rate DOUBLE,                 -- share of the checkable prompts answered right
            reason VARCHAR
        )
        """
    )


def m013_kv_cache(con: duckdb.DuckDBPyConnection) -> None:
    # The KV-cache policy a run ran under (`--kv-cache`: full, window:W, sinkwindow:S:W, fp8,
    # quantized:BACKEND:BITS), a run dimension like quant and template. NULL where evalkit does
    # not control the cache (vLLM, API models). Runs of the hf backend from before the option
    # ran with the full cache, and say so.
    import json

    con.execute("ALTER TABLE runs ADD COLUMN kv_cache VARCHAR")
    full = []
    for run_id, config in con.execute("SELECT id, config FROM runs").fetchall():
        try:
            model = json.loads(config or "{}").get("model")
        except (ValueError, AttributeError):
            continue
        if model == "hf":
            full.append(run_id)
    if full:
        con.execute("UPDATE runs SET kv_cache = 'full' WHERE id IN (SELECT unnest(?::VARCHAR[]))", [full])
    con.execute(
        """
        CREATE OR REPLACE VIEW leaderboard AS
        SELECT r.id AS run_id, r.name, r.model, r.model_name, r.model_fingerprint, r.quant, r.template,
               r.kv_cache, r.first_temperature, r.ban_openers, r.created_at,
               m.task, m.metric, m.value, m.stderr, m.n,
               coalesce(m.ci_lo, m.value - 1.96 * m.stderr) AS ci_lo,
               coalesce(m.ci_hi, m.value + 1.96 * m.stderr) AS ci_hi
        FROM runs r JOIN metrics m ON m.run_id = r.id
        WHERE r.status = 'done'
        """
    )


def m014_quant_detail(con: duckdb.DuckDBPyConnection) -> None:
    # What `--quant` applied, as JSON (`quant.describe`): variant, library and version, scheme,
    # bits, group size, compute dtype, the quantized modules as layer patterns with counts and
    # the weight-holding modules left as they were. The leaderboard keeps every column m013 gave
    # it and ends with this one.
    con.execute("ALTER TABLE runs ADD COLUMN quant_detail VARCHAR")
    con.execute(
        """
        CREATE OR REPLACE VIEW leaderboard AS
        SELECT r.id AS run_id, r.name, r.model, r.model_name, r.model_fingerprint, r.quant, r.template,
               r.kv_cache, r.first_temperature, r.ban_openers, r.created_at,
               m.task, m.metric, m.value, m.stderr, m.n,
               coalesce(m.ci_lo, m.value - 1.96 * m.stderr) AS ci_lo,
               coalesce(m.ci_hi, m.value + 1.96 * m.stderr) AS ci_hi,
               r.quant_detail
        FROM runs r JOIN metrics m ON m.run_id = r.id
        WHERE r.status = 'done'
        """
    )


def m015_attention_and_conflict(con: duckdb.DuckDBPyConnection) -> None:
    # Where the model looks (docs/metrics.md §1.8) and conflicting facts (§1.9), and start_gap (§1.6).
    # The run records whether it read attention and the attention implementation its model ran.
    con.execute("ALTER TABLE runs ADD COLUMN attention BOOLEAN")
    con.execute("ALTER TABLE runs ADD COLUMN attn_implementation VARCHAR")
    # Per-sample values: attention (needs --attention), the conflict pick and its values.
    # needle_length / needle_tokens also hold the requested / actual length of conflict documents.
    for column, kind in (("sink_rate", "DOUBLE"), ("needle_attn", "DOUBLE"), ("question_attn", "DOUBLE"),
                         ("first_wins", "DOUBLE"), ("last_wins", "DOUBLE"), ("conflict_both", "DOUBLE"),
                         ("conflict_pick", "VARCHAR"),   # first / last / both / neither
                         ("conflict_pair", "VARCHAR"),   # the id both orders of a pair share
                         ("conflict_order", "VARCHAR")):  # ab (A first) / ba (B first)
        con.execute(f"ALTER TABLE samples ADD COLUMN {column} {kind}")
    # One row per sample and layer of an --attention run: the layer's share of sink heads, the
    # first token's importance (mean over heads) and the last position's mass on the needle or question.
    con.execute(
        """
        CREATE TABLE attention_layers (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            layer INTEGER NOT NULL,           -- 0 = the first decoder layer
            sink_rate DOUBLE,                 -- share of the layer's heads with alpha > 0.3
            sink_score DOUBLE,                -- alpha of the first token, mean over heads
            needle_attn DOUBLE,               -- needle documents
            question_attn DOUBLE              -- first-token prompts inside a template
        )
        """
    )
    # Recall at depth 0 against the later depths, per run, task and length: start_gap (and middle_gap).
    con.execute(
        """
        CREATE VIEW needle_gaps AS
        WITH cells AS (
            SELECT run_id, task, lang, needle_hint AS hint, needle_length AS length, needle_depth AS depth,
                   avg(needle_recall) AS recall
            FROM samples
            WHERE needle_depth IS NOT NULL AND needle_recall IS NOT NULL
            GROUP BY ALL
        )
        SELECT run_id, task, lang, hint, length,
               avg(recall) FILTER (WHERE depth < 1e-9) AS recall_start,
               avg(recall) FILTER (WHERE depth >= 0.25 - 1e-9) AS recall_after,
               avg(recall) FILTER (WHERE depth >= 0.25 - 1e-9) - avg(recall) FILTER (WHERE depth < 1e-9)
                   AS start_gap,
               avg(recall) FILTER (WHERE depth < 1e-9 OR depth > 1 - 1e-9)
                   - avg(recall) FILTER (WHERE depth BETWEEN 0.3 - 1e-9 AND 0.7 + 1e-9) AS middle_gap,
               count(*) AS depths
        FROM cells
        GROUP BY ALL
        """
    )
    # Attention on the needle beside recall, per run, task, depth and length (--attention runs).
    con.execute(
        """
        CREATE VIEW needle_attention AS
        SELECT run_id, task, lang, needle_hint AS hint, needle_depth AS depth, needle_length AS length,
               avg(needle_recall) AS recall, avg(needle_attn) AS needle_attn, avg(sink_rate) AS sink_rate,
               count(*) AS n
        FROM samples
        WHERE needle_depth IS NOT NULL AND needle_attn IS NOT NULL
        GROUP BY ALL
        """
    )
    # The attention sink per run and layer, over every prompt of the run.
    con.execute(
        """
        CREATE VIEW attention_sink AS
        SELECT run_id, layer, avg(sink_rate) AS sink_rate, avg(sink_score) AS sink_score, count(*) AS n
        FROM attention_layers
        GROUP BY ALL
        """
    )
    # Which value wins, per run, task and length; recency_index = last_wins - first_wins; a pair
    # flips when its answer (value A, value B, both or neither) changes with the order.
    con.execute(
        """
        CREATE VIEW conflict_table AS
        WITH picks AS (
            SELECT run_id, task, lang, needle_length AS length, count(*) AS n,
                   avg(CAST(conflict_pick = 'first' AS DOUBLE)) AS first_wins,
                   avg(CAST(conflict_pick = 'last' AS DOUBLE)) AS last_wins,
                   avg(CAST(conflict_pick = 'both' AS DOUBLE)) AS picked_both,
                   avg(CAST(conflict_pick = 'neither' AS DOUBLE)) AS picked_neither
            FROM samples
            WHERE conflict_pick IS NOT NULL
            GROUP BY ALL
        ), pairs AS (
            SELECT run_id, task, any_value(needle_length) AS length,
                   any_value(conflict_pick) FILTER (WHERE conflict_order = 'ab') AS ab,
                   any_value(conflict_pick) FILTER (WHERE conflict_order = 'ba') AS ba
            FROM samples
            WHERE conflict_pick IS NOT NULL
            GROUP BY run_id, task, conflict_pair
        ), flips AS (
            SELECT run_id, task, length, count(*) AS pairs,
                   avg(CAST((CASE ab WHEN 'first' THEN 'A' WHEN 'last' THEN 'B' ELSE ab END)
                            <> (CASE ba WHEN 'first' THEN 'B' WHEN 'last' THEN 'A' ELSE ba END) AS DOUBLE))
                       AS order_flip_rate
            FROM pairs
            WHERE ab IS NOT NULL AND ba IS NOT NULL
            GROUP BY ALL
        )
        SELECT p.run_id, p.task, p.lang, p.length, p.n, p.first_wins, p.last_wins, p.picked_both,
               p.picked_neither, p.last_wins - p.first_wins AS recency_index, f.pairs, f.order_flip_rate
        FROM picks p
        LEFT JOIN flips f ON f.run_id = p.run_id AND f.task = p.task AND f.length = p.length
        """
    )


def m016_topk_units(con: duckdb.DuckDBPyConnection) -> None:
    # The first unit (docs/metrics.md §1.0) each of a prompt's likeliest first tokens starts:
    # a byte of a split Chinese character decodes to "�" alone; its unit is the character
    # greedy decoding completes it to. NULL past the ranks evalkit completes and before m016.
    con.execute("ALTER TABLE first_token_topk ADD COLUMN unit VARCHAR")


def m017_db_identity(con: duckdb.DuckDBPyConnection) -> None:
    # Who this DB is, apart from its file name: a run kept in a spool file names the DB it
    # belongs to by `db_uuid`, and signs its content with `spool_key` (HMAC-SHA256), so that
    # a file planted in the spool folder, or another DB's kept run, is never brought in.
    import secrets
    import uuid

    con.execute("INSERT INTO evalkit_meta VALUES ('db_uuid', ?), ('spool_key', ?)",
                [uuid.uuid4().hex, secrets.token_hex(32)])


def m019_drift_by_position(con: duckdb.DuckDBPyConnection) -> None:
    # Drift by position (docs/drift.md): a run that teacher-forced a base run's greedy tokens, compared
    # with the base at every response position. `response_tokens`: the greedy tokens a base run
    # produced (the answer continuation where there is one), the ones a candidate teacher-forces.
    # `drift_base`: a base's distributions kept compact (`--keep-distributions`): per position its
    # likeliest tokens covering all but `eps` of the mass, and that tail's exact mass.
    con.execute(
        """
        CREATE TABLE response_tokens (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            token_ids INTEGER[] NOT NULL
        )
        """
    )
    con.execute(
        """
        CREATE TABLE drift_base (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            position INTEGER NOT NULL,        -- 0 = the first response token
            token_ids INTEGER[] NOT NULL,     -- likeliest first
            logprobs FLOAT[] NOT NULL,        -- natural log, same order
            tail DOUBLE NOT NULL,             -- mass of every other token, <= eps
            eps DOUBLE NOT NULL
        )
        """
    )
    con.execute(
        """
        CREATE TABLE drift (
            run_id VARCHAR NOT NULL,          -- the candidate, which teacher-forced the base's tokens
            base_run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            position INTEGER NOT NULL,
            kld DOUBLE NOT NULL,              -- KL(base || run), nats, over the base's compact support
            same_top BOOLEAN NOT NULL,
            dp DOUBLE NOT NULL,               -- Q(y) - P(y), y the base's greedy token
            kld_bound DOUBLE NOT NULL         -- the exact KLD lies in [kld, kld + kld_bound]
        )
        """
    )
    pct = ["max", "p999", "p99", "p95", "p90", "median", "p10", "p5", "p1", "p01", "min"]
    dp_pct = ["max", "p999", "p99", "p95", "p90", "p75", "median", "p25", "p10", "p5", "p1", "p01", "min"]
    cols = ",\n".join([f"kld_{c} DOUBLE" for c in pct] + [f"dp_{c} DOUBLE" for c in dp_pct])
    con.execute(
        f"""
        CREATE TABLE drift_summary (
            run_id VARCHAR NOT NULL,
            base_run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            bucket VARCHAR NOT NULL,          -- all, 0, 1, 2-3, 4-7, 8-15, 16+
            n INTEGER NOT NULL,               -- positions
            kld_mean DOUBLE, kld_unc DOUBLE,
            dp_mean DOUBLE, dp_unc DOUBLE,
            dp_rms DOUBLE, dp_rms_unc DOUBLE,
            same_top DOUBLE, same_top_unc DOUBLE,
            kld_bound_max DOUBLE,
            {cols}
        )
        """
    )
    # per position: mean KLD, same-top share and mean Δp over the prompts that reach it
    con.execute(
        """
        CREATE VIEW drift_by_position AS
        SELECT run_id, base_run_id, task, position, count(*) AS n,
               avg(kld) AS kld, avg(CAST(same_top AS DOUBLE)) AS same_top, avg(dp) AS dp,
               max(kld_bound) AS kld_bound
        FROM drift
        GROUP BY ALL
        """
    )
    # the same per position bucket (restates scoring.drift.bucket and summary's means; a test ties them)
    con.execute(
        """
        CREATE VIEW drift_by_bucket AS
        SELECT run_id, base_run_id, task,
               CASE WHEN position = 0 THEN '0' WHEN position = 1 THEN '1' WHEN position <= 3 THEN '2-3'
                    WHEN position <= 7 THEN '4-7' WHEN position <= 15 THEN '8-15' ELSE '16+' END AS bucket,
               min(position) AS first_position,
               count(*) AS n, avg(kld) AS kld_mean, avg(CAST(same_top AS DOUBLE)) AS same_top,
               sqrt(avg(dp * dp)) AS dp_rms
        FROM drift
        GROUP BY ALL
        """
    )
    # the stored summaries with each side's run dimensions: what a quantization sweep's reader wants
    con.execute(
        """
        CREATE VIEW drift_runs AS
        SELECT s.run_id, s.base_run_id, r.quant, b.quant AS base_quant, r.template, r.kv_cache,
               s.task, s.bucket, s.n, s.kld_mean, s.kld_unc, s.same_top, s.same_top_unc,
               s.dp_mean, s.dp_rms, s.kld_p99, s.kld_max, s.kld_bound_max
        FROM drift_summary s JOIN runs r ON r.id = s.run_id LEFT JOIN runs b ON b.id = s.base_run_id
        """
    )


def m018_engine(con: duckdb.DuckDBPyConnection) -> None:
    # The engine that computed a run's numbers (transformers, llama.cpp, openai-server, vllm), a run
    # dimension like quant and template (docs/engines.md), and `unavailable`: JSON {metric: reason} of
    # the metrics the engine could not compute (NULL in every sample, never silently absent). Runs
    # from before m018 were computed by the model type their config names: hf -> transformers,
    # vllm -> vllm; any other lm-eval model type stays NULL. The leaderboard ends with `engine`.
    import json

    con.execute("ALTER TABLE runs ADD COLUMN engine VARCHAR")
    con.execute("ALTER TABLE runs ADD COLUMN unavailable VARCHAR")
    engines = {"hf": "transformers", "hf-auto": "transformers", "huggingface": "transformers",
               "evalkit-hf": "transformers", "vllm": "vllm", "evalkit-vllm": "vllm"}
    found: dict[str, list[str]] = {}
    for run_id, config in con.execute("SELECT id, config FROM runs").fetchall():
        try:
            model = json.loads(config or "{}").get("model")
        except (ValueError, AttributeError):
            continue
        if model in engines:
            found.setdefault(engines[model], []).append(run_id)
    for engine, ids in found.items():
        con.execute("UPDATE runs SET engine = ? WHERE id IN (SELECT unnest(?::VARCHAR[]))", [engine, ids])
    con.execute(
        """
        CREATE OR REPLACE VIEW leaderboard AS
        SELECT r.id AS run_id, r.name, r.model, r.model_name, r.model_fingerprint, r.quant, r.template,
               r.kv_cache, r.first_temperature, r.ban_openers, r.created_at,
               m.task, m.metric, m.value, m.stderr, m.n,
               coalesce(m.ci_lo, m.value - 1.96 * m.stderr) AS ci_lo,
               coalesce(m.ci_hi, m.value + 1.96 * m.stderr) AS ci_hi,
               r.quant_detail, r.engine
        FROM runs r JOIN metrics m ON m.run_id = r.id
        WHERE r.status = 'done'
        """
    )


def m020_answer_prob(con: duckdb.DuckDBPyConnection) -> None:
    # answer_prob (docs/metrics.md §1.7): the model's teacher-forced probability that its response
    # begins with a checkable answer (answers_full), the exact, continuous twin of answer_hit that
    # the gate can decide on a CI-sized run (docs/gate.md). Runs from before it hold NULL.
    con.execute("ALTER TABLE samples ADD COLUMN answer_prob DOUBLE")


def m021_tokenizer_identity(con: duckdb.DuckDBPyConnection) -> None:
    # Which tokenizer a run's token ids belong to (docs/metrics.md §1.5): a sha256 of the
    # vocabulary, merges / model type, normalizer, pre-tokenizer and added tokens
    # (`engines.tokenizer_id`), and the engine's words for where it came from. Runs from before
    # m021 hold NULL ("unknown"; `compare` then decides from the model fingerprint and the stored
    # top-k texts). first_token_drift pairs token ids, which mean one thing only within one
    # tokenizer: it gains `same_tokenizer` (NULL where either run's is unknown); `evalkit compare`
    # compares runs on different tokenizers by what their tokens say.
    con.execute("ALTER TABLE runs ADD COLUMN tokenizer_hash VARCHAR")
    con.execute("ALTER TABLE runs ADD COLUMN tokenizer_source VARCHAR")
    con.execute(
        """
        CREATE OR REPLACE VIEW first_token_drift AS
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
               CAST(a.top1 <> b.top1 AS INTEGER) AS flipped,
               ra.tokenizer_hash = rb.tokenizer_hash AS same_tokenizer
        FROM top a JOIN top b
          ON a.task = b.task AND a.doc_id = b.doc_id AND a.run_id <> b.run_id
        JOIN runs ra ON ra.id = a.run_id
        JOIN runs rb ON rb.id = b.run_id
        """
    )


def m022_no_interval_from_few_prompts(con: duckdb.DuckDBPyConnection) -> None:
    # No interval from too few prompts (docs/gate.md): the leaderboard shows a stored interval
    # from 10 prompts on (a proportion's score interval; new runs store a mean's bootstrap one
    # from 20), and value ± 1.96 stderr, for rows stored before evalkit kept intervals, from 20.
    # The counts are written out: a migration states what its schema was (defaults.MIN_* today).
    con.execute(
        """
        CREATE OR REPLACE VIEW leaderboard AS
        SELECT r.id AS run_id, r.name, r.model, r.model_name, r.model_fingerprint, r.quant, r.template,
               r.kv_cache, r.first_temperature, r.ban_openers, r.created_at,
               m.task, m.metric, m.value, m.stderr, m.n,
               CASE WHEN m.n < 10 THEN NULL WHEN m.ci_lo IS NOT NULL THEN m.ci_lo
                    WHEN m.n >= 20 THEN m.value - 1.96 * m.stderr END AS ci_lo,
               CASE WHEN m.n < 10 THEN NULL WHEN m.ci_hi IS NOT NULL THEN m.ci_hi
                    WHEN m.n >= 20 THEN m.value + 1.96 * m.stderr END AS ci_hi,
               r.quant_detail, r.engine
        FROM runs r JOIN metrics m ON m.run_id = r.id
        WHERE r.status = 'done'
        """
    )


def m023_tag_history(con: duckdb.DuckDBPyConnection) -> None:
    """Tags become a history: `tag:NAME` is the run of the tag's newest row (its `created_at`,
    the time of the promotion), and `promote` appends a row each time, so promoting an older
    run again moves the tag back (a rollback). Before, `tag:NAME` was the newest run by start
    time among the runs holding the tag, and a second promotion of a run wrote nothing.

    Existing rows are kept as they are. Where the two rules disagree (an older run was promoted
    after a newer one: the rollback that used to do nothing), one row is appended, at the
    upgrade's time, naming the run the old rule resolved to, so each tag names after the upgrade
    the run it named before; the history then shows that row as the newest promotion."""
    import datetime as dt

    now = dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)  # the naive UTC time evalkit stores
    con.execute(
        """
        INSERT INTO tags (tag, run_id, created_at)
        SELECT old.tag, old.run_id, ?
        FROM (SELECT t.tag, arg_max(t.run_id, (r.created_at, t.created_at)) AS run_id
              FROM tags t JOIN runs r ON r.id = t.run_id GROUP BY t.tag) old
        JOIN (SELECT tag, arg_max(run_id, created_at) AS run_id FROM tags GROUP BY tag) latest
          ON latest.tag = old.tag
        WHERE latest.run_id <> old.run_id
        """,
        [now],
    )


def m024_gates(con: duckdb.DuckDBPyConnection) -> None:
    # The gate's decisions (docs/gate.md): one `gates` row per `evalkit gate` that was recorded
    # (not with --no-record), and one `gate_checks` row per row of its verdict table.
    con.execute(
        """
        CREATE TABLE gates (
            id VARCHAR PRIMARY KEY,
            created_at TIMESTAMP NOT NULL,
            candidate VARCHAR NOT NULL,
            baseline VARCHAR NOT NULL,
            baseline_ref VARCHAR,
            rules_name VARCHAR NOT NULL,
            rules_digest VARCHAR NOT NULL,
            verdict VARCHAR NOT NULL,
            n_pass INTEGER NOT NULL,
            n_fail INTEGER NOT NULL,
            n_inconclusive INTEGER NOT NULL,
            n_skipped INTEGER NOT NULL,
            holm_family INTEGER,
            evalkit_version VARCHAR NOT NULL
        )
        """
    )
    con.execute(
        """
        CREATE TABLE gate_checks (
            gate_id VARCHAR NOT NULL,
            position INTEGER NOT NULL,
            kind VARCHAR NOT NULL,
            task VARCHAR,
            metric VARCHAR NOT NULL,
            status VARCHAR NOT NULL,
            observed DOUBLE,
            baseline_value DOUBLE,
            bound DOUBLE,
            margin VARCHAR,
            drop DOUBLE,
            ci_lo DOUBLE,
            ci_hi DOUBLE,
            n INTEGER,
            method VARCHAR,
            p_fail DOUBLE,
            decide_n INTEGER,
            reason VARCHAR NOT NULL
        )
        """
    )


def m025_run_caps(con: duckdb.DuckDBPyConnection) -> None:
    # the caps an in-process engine ran under (`engines.caps`), derived from the model's shapes and a
    # working-memory budget: runs.batch_size holds the prompts a batch (what `--batch-size auto` chose),
    # these the padded positions a batch and a candidate-trie level, and the budget in bytes. NULL for
    # engines without them and for runs from before
    con.execute("ALTER TABLE runs ADD COLUMN batch_positions INTEGER")
    con.execute("ALTER TABLE runs ADD COLUMN trie_positions INTEGER")
    con.execute("ALTER TABLE runs ADD COLUMN memory_budget BIGINT")


def m026_metric_selection(con: duckdb.DuckDBPyConnection) -> None:
    # What a run computed (`evalkit run --metrics gate|all|NAME,...`): the selection as given. The metrics
    # it skipped are NULL in every sample, each with its reason in `unavailable` (which also holds what the
    # engine could not compute). Runs from before it computed every metric they could: 'all'.
    # `opener_start_mass` (docs/metrics.md §1.2): the first-step mass of the openers' first tokens, what
    # `--metrics gate` computes in opener_mass's place; runs from before it hold NULL.
    con.execute("ALTER TABLE runs ADD COLUMN metric_selection VARCHAR")
    con.execute("UPDATE runs SET metric_selection = 'all'")
    con.execute("ALTER TABLE samples ADD COLUMN opener_start_mass DOUBLE")


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
