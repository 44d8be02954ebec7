"""Migrations m011-m020: answers and lead indicators, KV cache, quantization detail, attention and
conflicts, top-k units, drift by position, engines, answer_prob.

Applied in `MIGRATIONS` order (the package's `__init__`; m014, m015 and m018 after later numbers);
never edited once applied."""

from __future__ import annotations

import duckdb


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


# this module's migrations in the order they are applied (the package's MIGRATIONS joins the modules'):
# a migration's place is its schema_version number, so one is appended where it was written, even
# when its name's number is lower
MIGRATIONS = (
    m011_run_model_name,
    m012_answers_and_lead_indicators,
    m013_kv_cache,
    m016_topk_units,
    m014_quant_detail,  # applied after m016
    m015_attention_and_conflict,
    m017_db_identity,
    m019_drift_by_position,
    m018_engine,  # after m019
    m020_answer_prob,
)
