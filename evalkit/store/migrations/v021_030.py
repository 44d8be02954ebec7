"""Migrations m021-: tokenizer identity, intervals from enough prompts, tag history, gate records,
the engine's caps, the metric selection. New migrations are appended here (a new file from m031).

Applied in `MIGRATIONS` order (the package's `__init__`); never edited once applied."""

from __future__ import annotations

import duckdb


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


def m027_fed_prefix(con: duckdb.DuckDBPyConnection) -> None:
    # What a run fed the model before every prompt's text (docs/metrics.md "The input a model expects"):
    # `fed` names the special tokens (e.g. "<bos> (id 2), declared by the tokenizer", "nothing, declared by
    # the tokenizer") and who chose them (the tokenizer's declaration, or the add_bos_token model arg);
    # `fed_note` is set when the first fed token is not the one the tokenizer declares. Runs from before
    # m027 hold NULL: they fed the text's own tokens, with no special token added, on every engine.
    con.execute("ALTER TABLE runs ADD COLUMN fed VARCHAR")
    con.execute("ALTER TABLE runs ADD COLUMN fed_note VARCHAR")


def m028_ws_mass(con: duckdb.DuckDBPyConnection) -> None:
    # `samples.ws_mass` (docs/metrics.md "One event for text and probability"): a first-token prompt's first-step
    # probability of the tokens that add only whitespace. From m028 on, ft_hit_prob, answer_prob and opener_mass
    # count the whitespace-led paths too (" Paris"; "\n\n" then "Paris"); runs from before hold NULL here and
    # scored the string right after the prompt only.
    con.execute("ALTER TABLE samples ADD COLUMN ws_mass DOUBLE")


def m029_degenerate_output(con: duckdb.DuckDBPyConnection) -> None:
    # Degenerate output (docs/metrics.md "Degenerate output", `scoring.degenerate`): one row per run x task (and
    # group) with its counts, the mean first-step mass on special tokens, the flag and its reason in words. The
    # per-prompt `samples.special_mass`: the first-step probability of the tokens that add no text (EOS, end of
    # turn, control tokens; `engines.vocab`). The model's identity as its file says it: `model_arch` (GGUF
    # general.architecture, a config's model_type) and `model_file_type` (GGUF general.file_type: Q4_K_M, Q4_1;
    # a config's torch_dtype); runs.model_name gets the file's own name. The leaderboard view gains the flag and
    # its reason (NULL: the run's task was not checked, e.g. a run from before m029). Runs from before hold NULL.
    con.execute(
        """
        CREATE TABLE degenerate (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            n INTEGER NOT NULL,
            n_empty INTEGER NOT NULL,
            n_at_once INTEGER NOT NULL,
            n_cut INTEGER NOT NULL,
            n_repeated INTEGER NOT NULL,
            special_mass DOUBLE,
            degenerate BOOLEAN NOT NULL,
            reason VARCHAR,
            example VARCHAR
        )
        """
    )
    con.execute("ALTER TABLE samples ADD COLUMN special_mass DOUBLE")
    con.execute("ALTER TABLE runs ADD COLUMN model_arch VARCHAR")
    con.execute("ALTER TABLE runs ADD COLUMN model_file_type VARCHAR")
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
               r.quant_detail, r.engine,
               d.degenerate, d.reason AS degenerate_reason
        FROM runs r JOIN metrics m ON m.run_id = r.id
        LEFT JOIN degenerate d ON d.run_id = r.id AND d.task = m.task
        WHERE r.status = 'done'
        """
    )


def m030_first_char_topk(con: duckdb.DuckDBPyConnection) -> None:
    # The first character of the response from the whole next-token distribution (docs/metrics.md §1.5,
    # `engines.firstchar`): per prompt the likeliest events (a character, or a special token's role such as
    # <eos>) and their probabilities, rank 0 the likeliest. samples.fc_rest_mass: the resolved probability of
    # the events past the stored ones; samples.fc_unresolved_mass: the probability of the prefixes the run's
    # tolerance left unexpanded. Across tokenizers `compare` and the gate's js_div read this table; runs from
    # before m030 have no rows and keep the stored top-k comparison.
    con.execute(
        """
        CREATE TABLE first_char_topk (
            run_id VARCHAR NOT NULL,
            task VARCHAR NOT NULL,
            doc_id VARCHAR NOT NULL,
            rank INTEGER NOT NULL,
            event VARCHAR NOT NULL,
            prob DOUBLE NOT NULL
        )
        """
    )
    con.execute("ALTER TABLE samples ADD COLUMN fc_rest_mass DOUBLE")
    con.execute("ALTER TABLE samples ADD COLUMN fc_unresolved_mass DOUBLE")


# this module's migrations in the order they are applied (the package's MIGRATIONS joins the modules'); append here
MIGRATIONS = (
    m021_tokenizer_identity,
    m022_no_interval_from_few_prompts,
    m023_tag_history,
    m024_gates,
    m025_run_caps,
    m026_metric_selection,
    m027_fed_prefix,
    m028_ws_mass,
    m029_degenerate_output,  # m027 (the lead's) and m028 (samples.ws_mass) go before it
    m030_first_char_topk,
)
