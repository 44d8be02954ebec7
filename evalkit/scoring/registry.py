"""The metric registry: the one place that says what each metric evalkit reports is.

Owns: every metric's name, level, direction, aggregation, unit, range, whether a
`samples` column holds its per-prompt value, and a one-line meaning. The gate's
directions, the report's order and arrows, the samples columns, `evalkit compare`,
`evalkit metrics` and docs/metrics.md's table all read this module; the task YAMLs'
`metric_list` must agree with it (a test checks). Does not: compute anything (the
functions live beside it in `scoring`, the distribution-level values in the backends).

Levels:
- text: read off the response text, any backend;
- distribution: read off the model's first-step distribution (logprobs needed);
- sampled: from N sampled first units (backends without logprobs);
- needle: per needle document;
- attention: read off the prefill's attention weights (`--attention`, hf backend);
- conflict: per conflicting-facts document (needle_conflict);
- derived: computed from a run's per-sample values (per depth, per length, gaps);
- pair: describes two runs side by side (`evalkit compare`).

A family such as ``needle_recall@depth{D}`` covers every name with that prefix.

A metric that describes without ranking (sink_rate, first_wins, recency_index) has no
direction (`higher_is_better` None): the report shows no arrow, and a gate regression on
it needs the direction from the rules file's `higher_is_better`.
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass

from evalkit.contract import CONFLICT, FIRSTTOKEN, NEEDLE
from evalkit.defaults import (DEGENERATE_SPECIAL_MASS, MIDDLE_BAND, SINK_EPSILON, SINK_TOKENS, UNSTABLE_BELOW,
                              WS_MASS_NOTE)
from evalkit.kinds import METRIC_LEVELS, RULE_SETS, Aggregation, EnginePhase, MarginKind, MetricLevel, MetricUnit

LEVELS = METRIC_LEVELS  # kinds.MetricLevel, in this order


@dataclass(frozen=True)
class Margin:
    """How much worse a candidate may be than its baseline on one metric and still pass.

    ``delta``: the drop (the increase, for a lower-is-better metric) may be at most ``value``.
    ``relative``: at most ``value`` × the baseline's mean over the paired prompts.
    """

    kind: MarginKind
    value: float
    why: str = ""  # the reason, in words (`evalkit metrics --margins`)

    def __str__(self) -> str:
        return f"{self.value:g}" if self.kind == "delta" else f"{100 * self.value:g} % of baseline"


# a share of prompts: 5 points is one prompt in 20, and about what a 200-500-prompt task resolves
_SHARE_MARGIN = Margin("delta", 0.05, "a share of prompts: 5 points is one prompt in 20, and about what a "
                       "200-500-prompt task can resolve (at 235 paired prompts with 5 % discordant pairs the "
                       "interval of the drop is about ±0.03)")


@dataclass(frozen=True)
class Metric:
    name: str  # a family ends in "{D}" / "{L}": needle_recall@depth{D}
    level: MetricLevel
    higher_is_better: bool | None  # the direction the gate and the report's arrows use; None: descriptive
    meaning: str  # one line a user reads in `evalkit metrics`
    unit: MetricUnit = "share"
    per_sample: bool = False  # a `samples` column of the same name holds the per-prompt value
    binary: bool = False  # per-prompt values are 0 or 1 (an interval on the mean is a proportion's)
    aggregation: Aggregation = "mean"
    lo: float = 0.0  # the range of the aggregate (hi None: unbounded)
    hi: float | None = 1.0
    margin: Margin | None = None  # the gate's default tolerated drop; None: a rule must give one
    # a 0/1 metric's exact, continuous twin (answer_hit -> answer_prob): under the default rules its
    # decided row speaks for this one's where the 0/1 outcomes cannot decide at the run's size
    twin: str | None = None
    # a cheaper metric `evalkit run --metrics gate` computes in its place (opener_mass -> opener_start_mass):
    # where a run did not compute this one, the default rules check the stand-in under its own margin
    stand_in: str | None = None
    # the engine phases its value is read off (`evalkit run --metrics` runs only those a selected metric
    # reads; `scoring.selection`): one skipped, the metric is NULL with the reason
    reads: tuple[EnginePhase, ...] = ("first_step",)
    doc: str | None = FIRSTTOKEN  # the kind of document it is scored on (`contract.DOC_KINDS`); None: any

    @property
    def arrow(self) -> str:
        return {True: "↑", False: "↓", None: "–"}[self.higher_is_better]

    @property
    def direction(self) -> str:
        return {True: "higher", False: "lower", None: "none"}[self.higher_is_better]

    @property
    def family(self) -> str | None:
        """The prefix of a family's names ("needle_recall@depth"), None for a single metric."""
        return self.name.split("{", 1)[0] if "{" in self.name else None

    def to_dict(self) -> dict:
        return {**asdict(self), "direction": self.direction, "margin": str(self.margin) if self.margin else None}


_METRICS = (  # in the order the report and `evalkit metrics` list them
    Metric("ft_hit", "text", True, "the response's first word (first k characters for CJK) is an accepted answer start",
           per_sample=True, binary=True, margin=_SHARE_MARGIN, twin="ft_hit_prob", reads=("response",)),
    Metric("ft_hit_prob", "distribution", True,
           "P(response begins with an accepted start): teacher-forced product over its tokens in context, "
           "summed over the starts", unit="probability", per_sample=True,
           margin=Margin("relative", 0.15, "its scale depends on the model (0.07 en / 0.01 zh on the default model, "
                         "0.5 and more on larger ones): keeping 85 % of the baseline's mass means the same at every "
                         "scale; int8 weight-only, a change users accept, loses 3-5 % of it, 10 % left it "
                         "undecided at 100 prompts a task (docs/gate.md)"), reads=("start_trie",)),
    Metric("ft_token_hit", "distribution", True,
           "the most likely first token is the first token of an accepted start", per_sample=True, binary=True,
           margin=_SHARE_MARGIN, reads=("start_trie",)),
    Metric("opener_rate", "text", False, "the response begins with an entry of the opener lexicon (Sure, 好的 ...)",
           per_sample=True, binary=True, margin=_SHARE_MARGIN, twin="opener_mass", reads=("response",)),
    Metric("opener_mass", "distribution", False,
           "P(response begins with an opener of the lexicon), summed over the entries", unit="probability",
           per_sample=True, margin=Margin("relative", 0.25, "a small probability (0-0.05 on the default model): "
                                          "an absolute margin either never fires or fires on noise"),
           reads=("opener_trie",), stand_in="opener_start_mass"),
    Metric("opener_start_mass", "distribution", False,
           "first-step probability of the tokens a lexicon opener begins with (in context): an upper bound on "
           "opener_mass from the prefill alone, what --metrics gate reads in its place", unit="probability",
           per_sample=True, margin=Margin("relative", 0.25, "as opener_mass's: a probability whose scale depends "
                                          "on the model and the language (docs/gate.md calibrates it)")),
    Metric("prior_drift", "distribution", False,
           "1 - JSD2(first-token distribution, content-free prior): 1 = the prompt changed nothing",
           unit="probability", per_sample=True,
           margin=Margin("delta", 0.02, "a similarity on a fixed 0-1 scale (0.43 en / 0.57 zh on the default "
                         "model); moving 0.02 toward the prior is a change worth a look, whatever the model")),
    Metric("top3_mass", "distribution", True,
           "mass of the 3 most likely first tokens at temperature T (the exact 'sample it 20 times' test)",
           unit="probability", per_sample=True),
    Metric("top3_share", "sampled", True, "share of the 3 most frequent first units among N samples at T",
           per_sample=True, reads=("response",)),
    Metric("unstable", "distribution", False, f"top3_mass (or the sampled top3_share) is below {UNSTABLE_BELOW:.2f}",
           per_sample=True, binary=True),
    Metric("entropy", "distribution", False, "entropy of the whole first-token distribution",
           unit="nats", per_sample=True, hi=None),
    Metric("top1_prob", "distribution", True, "probability of the most likely first token", unit="probability",
           per_sample=True),
    Metric("special_mass", "distribution", None,
           "first-step probability of the special tokens (EOS, end of turn, control tokens: those that add no "
           f"text); a task whose mean is above {DEGENERATE_SPECIAL_MASS} is flagged degenerate, never ranked",
           unit="probability", per_sample=True, doc=None),
    Metric("ws_mass", "distribution", None,
           "first-step probability of the tokens that add only whitespace (\"\\n\\n\", \" \"): how much the template "
           f"leaves the model to open with whitespace; a run whose mean is above {WS_MASS_NOTE} says so",
           unit="probability", per_sample=True),
    Metric("answer_hit", "text", True,
           "the whole answer is right: a checkable answer (answers_full) occurs in the greedy continuation",
           per_sample=True, binary=True, margin=_SHARE_MARGIN, twin="answer_prob", reads=("answer",)),
    Metric("answer_prob", "distribution", True,
           "P(response begins with a checkable answer, answers_full): teacher-forced product over its tokens "
           "in context, summed over the answers; the exact, continuous twin of answer_hit", unit="probability",
           per_sample=True,
           margin=Margin("relative", 0.20, "a probability whose scale depends on the model, and a product over "
                         "the answer's several tokens, so per-token changes compound: int8 weight-only loses 6-10 % "
                         "of it; exact per prompt, so a benign change decides at 100 prompts a task where "
                         "answer_hit's 0/1 outcomes cannot (docs/gate.md)"), reads=("answer_trie",)),
    Metric("ft_answer_mismatch", "distribution", False,
           "the first token and the whole answer disagree: ft_token_hit differs from answer_hit",
           per_sample=True, binary=True, reads=("start_trie", "answer")),
    Metric("lead_auroc.{S}", "derived", True,
           "AUROC of first-token signal S against answer_hit over the checkable prompts: does the first "
           "token predict the answer? (0.5 = no better than chance)", unit="auroc", aggregation="auroc",
           reads=("answer",)),
    Metric("needle_recall", "needle", True,
           "the needle's key appears in the response (digits, separators, width and case normalised)",
           per_sample=True, binary=True, margin=_SHARE_MARGIN, reads=("response",), doc=NEEDLE),
    Metric("needle_recall@depth{D}", "derived", True, "needle_recall of the documents with the needle at depth D",
           reads=("response",), doc=NEEDLE),
    Metric("needle_recall@len{L}", "derived", True, "needle_recall of the documents of L tokens",
           reads=("response",), doc=NEEDLE),
    Metric("start_gap", "derived", False,
           "mean recall at depths 0.25-1 minus recall at depth 0: positive = the first sentence is what gets lost",
           unit="difference", aggregation="difference of means", lo=-1.0, reads=("response",), doc=NEEDLE),
    Metric("start_gap@len{L}", "derived", False, "start_gap of the documents of L tokens",
           unit="difference", aggregation="difference of means", lo=-1.0, reads=("response",), doc=NEEDLE),
    Metric("middle_gap", "derived", False,
           f"recall at depths 0 and 1 minus recall at depths {MIDDLE_BAND[0]}-{MIDDLE_BAND[1]}: positive = lost in the middle",
           unit="difference", aggregation="difference of means", lo=-1.0, reads=("response",), doc=NEEDLE),
    Metric("sink_rate", "attention", None,
           f"share of (layer, head) pairs whose first-token importance over the first {SINK_TOKENS} prompt tokens "
           f"exceeds {SINK_EPSILON} "
           "(Gu et al. 2025, Sink1)", per_sample=True, doc=None),
    Metric("needle_attn", "attention", True,
           "attention mass the last prompt position puts on the needle sentence, mean over heads and layers",
           unit="probability", per_sample=True, doc=NEEDLE),
    Metric("question_attn", "attention", True,
           "attention mass the last prompt position puts on the question inside the template, mean over heads "
           "and layers", unit="probability", per_sample=True),
    Metric("first_wins", "conflict", None, "the response gives the first sentence's value and not the last's",
           per_sample=True, binary=True, reads=("response",), doc=CONFLICT),
    Metric("last_wins", "conflict", None, "the response gives the last sentence's value and not the first's",
           per_sample=True, binary=True, reads=("response",), doc=CONFLICT),
    Metric("conflict_both", "conflict", None, "the response gives both values", per_sample=True, binary=True,
           reads=("response",), doc=CONFLICT),
    Metric("recency_index", "derived", None, "last_wins - first_wins: +1 the end always wins, -1 the start always wins",
           unit="difference", aggregation="difference of means", lo=-1.0, reads=("response",), doc=CONFLICT),
    Metric("order_flip_rate", "derived", False,
           "share of value pairs whose answer changes when the two sentences swap places",
           aggregation="mean over pairs", reads=("response",), doc=CONFLICT),
    Metric("first_wins@len{L}", "derived", None, "first_wins of the conflict documents of L tokens",
           reads=("response",), doc=CONFLICT),
    Metric("last_wins@len{L}", "derived", None, "last_wins of the conflict documents of L tokens",
           reads=("response",), doc=CONFLICT),
    Metric("recency_index@len{L}", "derived", None, "recency_index of the conflict documents of L tokens",
           unit="difference", aggregation="difference of means", lo=-1.0, reads=("response",), doc=CONFLICT),
    Metric("order_flip_rate@len{L}", "derived", False, "order_flip_rate of the conflict documents of L tokens",
           aggregation="mean over pairs", reads=("response",), doc=CONFLICT),
    Metric("top5_mass", "pair", True, "mass of the 5 most likely first tokens of each run", unit="probability",
           aggregation="mean over shared prompts", doc=None),
    Metric("top5_overlap", "pair", True, "|top-5 of A and top-5 of B| / 5 (across tokenizers: of the top-5 "
           "first-character events)", aggregation="mean over shared prompts", doc=None),
    Metric("js_div", "pair", False, "Jensen-Shannon divergence of the two first-token distributions (by token id "
           "on one tokenizer, over the first character each token adds across tokenizers)",
           unit="bits", aggregation="mean over shared prompts",
           margin=Margin("delta", 0.02, "a distance on a fixed 0-1 scale (bits): benign changes of the default model "
                         "measure 0.002-0.008 (bf16, int8 weight-only, the same GGUF on llama.cpp), a broken one "
                         "(int8-dynamic) 0.085-0.095; it catches a candidate that changes much in no one direction, "
                         "which a drop of a mean cannot see"), doc=None),
    Metric("flip_rate", "pair", False, "share of shared prompts whose most likely first token (across "
           "tokenizers: first-character event) differs",
           aggregation="mean over shared prompts", doc=None),
    Metric("drift_kld@0", "pair", False,
           "KL(base || run) in nats at the first response token, the run teacher-forcing the base's greedy "
           "response (docs/drift.md)", unit="nats", hi=None, reads=("response", "answer"), doc=None),
    Metric("drift_first_ratio", "pair", None,
           "mean KLD from the base at the first response token / mean KLD at the later ones: > 1 = the "
           "first token drifts most (docs/drift.md)", unit="ratio", aggregation="ratio of means", hi=None,
           reads=("response", "answer"), doc=None),
)

METRICS: dict[str, Metric] = {m.name: m for m in _METRICS}

# the quality metrics: what "no worse" means (the gate's `upgrade` rules, non-inferiority only)
QUALITY_METRICS = ("ft_hit", "ft_hit_prob", "answer_hit", "answer_prob", "opener_rate", "opener_mass",
                   "needle_recall")
# the metrics the gate's default rules (`same`) check, each under its registered margin: quality, and
# the first-token distribution staying where it was (an equivalence check)
HEADLINE_METRICS = QUALITY_METRICS + ("js_div",)
# the gate's shipped rule sets (kinds.RuleSet; docs/gate.md): each metric under its registered margin
RULE_SET_METRICS: dict[str, tuple[str, ...]] = {"same": HEADLINE_METRICS, "upgrade": QUALITY_METRICS}
RULE_SET_QUESTIONS: dict[str, str] = {
    "same": "is the candidate the same model, cheaper? (quality no worse and the first-token distribution "
            "unchanged: a quantization, a cast, a KV-cache policy)",
    "upgrade": "is the candidate no worse? (quality only, no equivalence check: a new model, a fine-tune, "
               "another template)",
}
# pair metrics the gate checks per prompt: the candidate's distance from the baseline on each shared prompt
# (`release.db.with_distances`, from both runs' stored top-k); the baseline's own distance is 0
DISTANCE_METRICS = ("js_div",)
# a distance whose pairing can leave part of the two distributions undecided (across tokenizers: the mass
# outside the stored events) carries its per-prompt upper bound beside it: the key of the bound in the
# pairing's prompt (`compare.pair_topk`); the gate passes its rule only when the bound passes too
DISTANCE_BOUNDS = {"js_div": "js_hi"}
assert all(METRICS[m].margin for m in HEADLINE_METRICS), "a headline metric without a default margin"
assert tuple(RULE_SET_METRICS) == RULE_SETS == tuple(RULE_SET_QUESTIONS), "a rule set without its metrics or question"
assert set(DISTANCE_BOUNDS) <= set(DISTANCE_METRICS), "a bound on a distance the gate does not check"


def upper_bound_key(metric: str) -> str | None:
    """The samples key under which a gated pair carries `metric`'s per-prompt upper bound
    (`DISTANCE_BOUNDS`; `release.db.with_distances`), or None for a metric without one.

    >>> upper_bound_key("js_div"), upper_bound_key("ft_hit")
    ('js_div@hi', None)
    """
    return f"{metric}@hi" if metric in DISTANCE_BOUNDS else None


# what `evalkit run --metrics gate` computes: what the default rules read. A 0/1 headline metric is read
# through its exact twin (the default rules leave its row to the twin's where its 0/1 outcomes cannot
# decide, `release.decide._twins_speak`), whose probabilities need no decode; tests/test_metric_selection.py
# holds this to `release.rules.DEFAULT_RULES`
def gate_reads(name: str) -> str:
    """The metric `--metrics gate` computes for a default rule on `name`: its exact twin (a 0/1 metric's),
    and a stand-in's in place of a metric whose computation the gate cannot afford.

    >>> gate_reads("ft_hit"), gate_reads("opener_rate"), gate_reads("js_div")
    ('ft_hit_prob', 'opener_start_mass', 'js_div')
    """
    metric = METRICS[name]
    if metric.twin:
        return gate_reads(metric.twin)
    return metric.stand_in or name


GATE_METRICS = tuple(dict.fromkeys(gate_reads(m) for m in HEADLINE_METRICS))
assert all(METRICS[t].per_sample and not METRICS[t].binary for m in METRICS.values() if (t := m.twin)), "a bad twin"
assert all(METRICS[t].per_sample and METRICS[t].margin for m in METRICS.values() if (t := m.stand_in)), "a bad stand-in"
_FAMILIES = {m.family: m for m in _METRICS if m.family}

# first-token signals whose AUROC against answer_hit is reported (lead_auroc.{S}), in table order
LEAD_SIGNALS = ("ft_hit_prob", "top1_prob", "entropy", "top3_mass", "opener_mass", "prior_drift", "ft_hit")


def _number(text: str, kind=float, lo: float = 0.0, hi: float = float("inf")) -> bool:
    try:
        return lo <= kind(text) <= hi
    except ValueError:
        return False


# what may stand for a family's placeholder: needle_recall@depth0.5 names a metric,
# needle_recall@depthX or lead_auroc.ft_hitt does not
_MEMBERS = {
    "{D}": lambda s: _number(s, float, 0.0, 1.0),
    "{L}": lambda s: _number(s, int, 1),
    "{S}": lambda s: s in LEAD_SIGNALS,
}
assert all(m.name[len(m.family or ""):] in _MEMBERS for m in _FAMILIES.values()), "a family without a member check"


def get(name: str) -> Metric | None:
    """The metric called `name` (a family member such as needle_recall@depth0.5 included), or None.

    >>> get("ft_hit").level, get("needle_recall@depth0.5").name, get("ft_hitt")
    ('text', 'needle_recall@depth{D}', None)
    >>> get("lead_auroc.entropy").name, get("lead_auroc.entropyy"), get("needle_recall@depth2")
    ('lead_auroc.{S}', None, None)
    """
    if name in METRICS:
        return METRICS[name]
    for prefix, metric in _FAMILIES.items():
        if name.startswith(prefix) and _MEMBERS[metric.name[len(prefix):]](name[len(prefix):]):
            return metric
    return None


def value_range(name: str) -> tuple[float, float | None] | None:
    """The range (lo, hi; hi None: unbounded) an aggregate of `name` can take; None for a metric the
    registry does not know.

    >>> value_range("ft_hit"), value_range("entropy"), value_range("needle_gap"), value_range("x")
    ((0.0, 1.0), (0.0, None), None, None)
    """
    metric = get(name)
    return None if metric is None else (metric.lo, metric.hi)


def margin(name: str) -> Margin | None:
    """The gate's default margin for `name`, None when the registry gives none.

    >>> str(margin("ft_hit_prob")), str(margin("ft_hit")), margin("entropy")
    ('15 % of baseline', '0.05', None)
    """
    metric = get(name)
    return None if metric is None else metric.margin


def higher_is_better(name: str) -> bool | None:
    """The registered direction of `name`, None when evalkit does not know the metric."""
    metric = get(name)
    return None if metric is None else metric.higher_is_better


def per_sample_columns() -> tuple[str, ...]:
    """The metrics whose per-prompt values are `samples` columns, in registry order."""
    return tuple(m.name for m in _METRICS if m.per_sample)


def sort_key(name: str) -> tuple:
    """Registry order first (a family's members by their number), then unknown names alphabetically."""
    metric = get(name)
    if metric is None:
        return (len(_METRICS), 0.0, name)
    suffix = name[len(metric.family):] if metric.family else ""
    try:
        number = float(suffix) if suffix else 0.0
    except ValueError:
        number = 0.0
    return (_METRICS.index(metric), number, name)


def suggest(name: str, known: list[str] | None = None) -> str:
    """A ' (did you mean X?)' hint for a misspelled name, or ''.

    >>> suggest("ft_hitt"), suggest("zzz")
    (' (did you mean ft_hit?)', '')
    """
    pool = list(known) if known is not None else list(METRICS)
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def all_metrics() -> tuple[Metric, ...]:
    return _METRICS
