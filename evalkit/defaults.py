"""Every default a run or a look at one prompt starts from, and every threshold more than one module reads.

Owns: the `DEFAULT_*` values that `RunConfig`, the click options of `evalkit run` and
`evalkit inspect`, `engines.resolve`, every engine (transformers, llama.cpp, server, vLLM) and `inspection.inspect_prompt` all
point at, and the named thresholds of the metrics (the `unstable` cut, the needle's
middle band, the attention sink's T and ε), so each is written once. Does not: check
values (`runner.config` does), or hold a closed set of names (`evalkit.kinds`).

>>> DEFAULT_MODEL, DEFAULT_TEMPLATE, DEFAULT_TOP_K, DEFAULT_TEMPERATURE
('hf', 'chat', 50, 0.8)
>>> MIDDLE_BAND
(0.3, 0.7)
>>> DEGENERATE_SHARE, DEGENERATE_SPECIAL_MASS, REPEAT_MIN_COPIES, REPEAT_MAX_UNIT
(0.5, 0.5, 3, 8)
"""

from __future__ import annotations

from typing import Final

# --- a run (`RunConfig`, `evalkit run`, `evalkit.run`) ---
DEFAULT_MODEL: Final = "hf"  # lm-eval model type; `hf` with no model args runs the embedded SmolLM2
DEFAULT_TEMPLATE: Final = "chat"  # prompt template (evalkit/data/templates.yaml)
DEFAULT_SEED: Final = 1234  # lm-eval's seeds and the needle grid's keys and fillers
# prompts per batch (a batch also holds at most BATCH_TOKENS positions): a batch decodes its
# continuations together, and a step of 32 rows costs little more than one of 8 (docs/performance.md)
DEFAULT_BATCH_SIZE: Final = 32
# the most positions a batch of evalkit-hf holds once padded: 2 prompts of 2048 tokens (8 of 576).
# On the default model each prompt of 2048 tokens adds about 0.42 GB to a plain run's peak RSS
# (its KV cache, and the prefill's per-layer attention scores), so a needle run at 2048 tokens
# peaks at 1.44 / 1.87 / 2.27 GB with 1 / 2 / 3 prompts a batch, against the 2 GB budget
BATCH_TOKENS: Final = 4608
# the working memory (bytes) an in-process engine's tensors may take beyond the weights: its batch, trie
# and decode caps are derived from it and the model's shapes (`engines.caps`); the default model gets
# DEFAULT_BATCH_SIZE prompts, BATCH_TOKENS positions and 512-position trie levels from it
MEMORY_BUDGET: Final = 2**30
# `--batch-size auto` on a GPU: the share of the device memory free after the load that is the budget
AUTO_DEVICE_SHARE: Final = 0.8
AUTO_BATCH: Final = "auto"  # --batch-size auto: the prompts a batch derived like its positions
MAX_BATCH_SIZE: Final = 4096  # the largest --batch-size taken (and the most prompts `auto` derives)
# first-token candidates stored per prompt; the prior-drift support rule needs k >= 50 (SPEC §1.3)
DEFAULT_TOP_K: Final = 50
MIN_TOP_K: Final = 50
# The fewest prompts an interval may rest on, printed or stored (docs/gate.md "Too few prompts"): a score
# interval (Wilson's, Tango's) keeps close to its level from about 10; a percentile bootstrap draws the
# interval from the sample's own spread and runs narrow on small samples, so it waits for 20; an AUROC's
# bootstrap resamples each class, so it needs that many of each: with one right answer of 42 every
# resample that holds it ranks it alike and the interval collapses to a point
MIN_SCORE_INTERVAL_PROMPTS: Final = 10
MIN_BOOTSTRAP_PROMPTS: Final = 20
MIN_AUROC_CLASS: Final = 10
DEFAULT_TEMPERATURE: Final = 0.8  # T of top3_mass@T (SPEC §1.4)
# opener probability a prompt may leave unscored in the candidate trie (0: exact); ft_hit_prob is always exact
DEFAULT_TOLERANCE: Final = 1e-4
# what `evalkit run` computes (`--metrics`, `scoring.selection`): every metric; "gate" is what the gate reads
DEFAULT_METRICS: Final = "all"
DEFAULT_ANSWER_TOKENS: Final = 48  # how far a prompt with checkable answers is continued (answer_hit)
DEFAULT_MAX_GEN_TOKS: Final = 256  # a response's length when its task sets no max_gen_toks (lm-eval's HFLM's)

# --- `--model server` (an OpenAI-compatible server) ---
DEFAULT_SERVER_LOGPROBS: Final = 20  # top_logprobs: the OpenAI API's cap, which most servers keep
DEFAULT_SERVER_CONCURRENCY: Final = 4  # parallel requests
DEFAULT_SERVER_RETRIES: Final = 3  # tries after a failed request
DEFAULT_SERVER_TIMEOUT_S: Final = 120  # seconds per request

# --- `evalkit inspect` ---
DEFAULT_INSPECT_TOP_K: Final = 10  # first tokens listed
DEFAULT_INSPECT_TASK: Final = "firsttoken_en"  # whose generation settings (until, max_gen_toks) the response uses
DEFAULT_ATTENTION_LAYERS: Final = 4  # with --attention: the last N layers averaged

# --- the needle tasks ---
# max_gen_toks of the needle and needle_conflict tasks (a Chinese answer spends 2-3 tokens a
# character); their YAMLs restate it, tests/test_defaults.py ties them to this value
GEN_TOKENS: Final = 48

# --- shared thresholds ---
UNSTABLE_BELOW: Final = 0.70  # a prompt is unstable when its top3_mass (or sampled top3_share) is below this
# the needle's middle depths, both ends included: `middle_gap`'s middle and the hint's "middle" region
MIDDLE_BAND: Final = (0.3, 0.7)
SINK_TOKENS: Final = 64  # T of Gu et al. 2025: α averages the first min(T, n) query positions
SINK_EPSILON: Final = 0.3  # ε of Gu et al. 2025: a head is a sink head when α > ε
# a Jensen-Shannon divergence (bits) between first-character distributions below this is float
# rounding, read as 0: two distributions equal up to the last bits (a permuted-id twin, whose
# log-softmax sums its terms in another order) compute to about 1e-16, their true distance to 1e-32
JSD_ROUNDING: Final = 1e-12
# degenerate output (`scoring.degenerate`, docs/metrics.md "Degenerate output"): a run's task is flagged, and never
# ranked, when more than DEGENERATE_SHARE of its responses are empty (no visible character: the model ended at once,
# or gave whitespace only) or one unit repeated ("????????", "</h4></h4></h4>"), or when its mean first-step mass on
# the special tokens (EOS, end of turn, any control token) is above DEGENERATE_SPECIAL_MASS
DEGENERATE_SHARE: Final = 0.5
DEGENERATE_SPECIAL_MASS: Final = 0.5
# a response "repeats one token or character" when, its whitespace removed, it is at least REPEAT_MIN_COPIES copies
# of one unit of at most REPEAT_MAX_UNIT characters (the last copy may be cut short by the token limit)
REPEAT_MIN_COPIES: Final = 3
REPEAT_MAX_UNIT: Final = 8
# a run whose mean first-step mass on whitespace-only tokens (`ws_mass`, docs/metrics.md "One event for text and
# probability") is above this is told, in its summary, that its template leaves the model to open with whitespace
WS_MASS_NOTE: Final = 0.5
