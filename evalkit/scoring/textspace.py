"""First-token distributions compared across tokenizers, on what the tokens say (docs/metrics.md §1.5).

Owns, on plain values:
- `event`: the tokenizer-free event a first token stands for — the **first non-whitespace
  character** of the text it adds at the start of the response ("P" for " Paris", " Par" and
  "Paris" alike); `WHITESPACE` for a token that adds only whitespace (or nothing); and for a token
  that ends inside a UTF-8 character (a byte-fallback `<0xE5>`, a byte-level BPE fragment, stored
  as text holding "\ufffd"), `byte:XX`, its lead byte, read from the first unit the run stored for
  it (`first_token_topk.unit`, the character greedy decoding completed it to), or `BYTE_UNKNOWN`;
- `merge`: a top-k list's mass summed by event (order-free: `math.fsum`), the rest one `OTHER`
  bucket (added by `stats.jsd`);
- `prompt_drift_text`: one prompt's top5_mass, top5_overlap, js_div and flip on that event space;
- `cut`: both top-k lists cut to the shorter K;
- `tokenizer_relation`: whether two runs' token ids mean the same texts (their stored tokenizer
  hashes; for runs stored without one, the model fingerprint or the stored top-k texts).

Why the first character: tokenizers cut text in different places (" Paris" in one, " Par" + "is"
in another), so whole token texts, or the first word, are not comparable events; the first
character is decided by the first token whenever that token holds one, whatever the cut.
Leading-space markers (Ġ, ▁) are skipped with the whitespace they stand for. A token ending inside
a character cannot say which character it begins, only its first byte; a tokenizer that spends
one token on 中 and another that spends three byte tokens on it then put their mass on different
events ("中" against "byte:E4"). The stored top-k cannot tell either way, so the point value
`js_div` is neither bound: two runs whose mass sits on fragments of different characters both
read `byte:?` and compare as equal. What the top-k leaves undecided — the rest past K, the
whitespace-only tokens (the character follows them) and every `byte:*` event — is bounded
instead: `js_hi` (`js_max`) is the largest JSD the whole distributions can have, `js_lo` the
smallest the metric property leaves (`js_bounds`); the gate passes a `js_div` rule only on
`js_hi` (`release.decide`).

Does not: read the DB (`compare`), or compare token ids (`compare.prompt_drift` does, for runs on
one tokenizer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from evalkit.defaults import JSD_ROUNDING
from evalkit.scoring import stats

TOP_N = 5
WHITESPACE = "<whitespace>"  # a token adding only whitespace, or nothing
BYTE_UNKNOWN = "byte:?"  # a token ending inside a character whose lead byte the run did not store
REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to
# each side's unlisted mass as an event of its own (`js_max`); no event is named so (an event is one
# character, byte:XX, or a <role>)
_REST_A, _REST_B = "rest of A", "rest of B"


@dataclass(frozen=True)
class TopToken:
    """One stored top-k row: the text the token decodes to alone, its first unit (may be None), its logprob."""

    text: str | None
    unit: str | None
    logprob: float


def _first_visible(text: str | None) -> str | None:
    for ch in text or "":
        if not ch.isspace():
            return ch
    return None


def event(text: str | None, unit: str | None = None) -> str:
    """The event a first token stands for (see the module docstring).

    >>> event(" Paris"), event(" Par"), event("Paris"), event("\\n\\n"), event("中国")
    ('P', 'P', 'P', '<whitespace>', '中')
    >>> event("\\ufffd", unit="中"), event(" \\ufffd", unit="é"), event("\\ufffd"), event("")
    ('byte:E4', 'byte:C3', 'byte:?', '<whitespace>')
    """
    ch = _first_visible(text)
    if ch is None:
        return WHITESPACE
    if ch != REPLACEMENT:
        return ch
    done = _first_visible(unit)
    if done is None or done == REPLACEMENT:
        return BYTE_UNKNOWN
    return f"byte:{done.encode('utf-8')[0]:02X}"


def merge(tokens: Sequence[TopToken]) -> dict[str, float]:
    """Mass by event, each event's mass an exact-rounded sum (`math.fsum`), so the order the tokens
    are listed in (ties broken by token id differ between tokenizers) does not change it.

    >>> m = merge([TopToken(" Paris", None, math.log(0.5)), TopToken(" Par", None, math.log(0.25)),
    ...            TopToken(" London", None, math.log(0.125))])
    >>> {k: round(v, 6) for k, v in m.items()}
    {'P': 0.75, 'L': 0.125}
    """
    parts: dict[str, list[float]] = {}
    for t in tokens:
        parts.setdefault(event(t.text, t.unit), []).append(math.exp(t.logprob))
    return {e: math.fsum(ps) for e, ps in parts.items()}


def _ranked(mass: Mapping[str, float]) -> list[str]:
    """Events by mass, then by name (a fixed order for ties)."""
    return sorted(mass, key=lambda e: (-mass[e], e))


def prompt_drift_text(a: Sequence[TopToken], b: Sequence[TopToken]) -> dict[str, float]:
    """One prompt's drift between two top-k lists on the first-character event space.

    `top5_mass_*`: the mass of each side's 5 likeliest tokens (a property of one run, as by id);
    `top5_overlap`: |top-5 events of A ∩ top-5 events of B| / min(5, events of A, events of B)
    (merging can leave fewer than 5 events); `js_div`: `stats.jsd` of the merged distributions
    (base 2, union of events plus one rest bucket), 0 below `JSD_ROUNDING` (float rounding of two
    distributions equal up to their last bits); `flipped`: the likeliest event differs; `js_lo` /
    `js_hi`: where the JSD of the whole distributions lies, the mass the events do not decide (rest,
    `<whitespace>`, `byte:*`) placed anywhere (module docstring).

    >>> lp = math.log
    >>> a = [TopToken(" Paris", None, lp(0.6)), TopToken(" London", None, lp(0.2))]
    >>> b = [TopToken(" Par", None, lp(0.6)), TopToken(" Lon", None, lp(0.2))]
    >>> d = prompt_drift_text(a, b)
    >>> (d["top5_overlap"], d["js_div"], d["flipped"], round(d["js_hi"], 6))
    (1.0, 0.0, 0.0, 0.2)
    >>> frag = lambda: [TopToken("\ufffd", None, lp(0.9)), TopToken("A", None, lp(0.1))]
    >>> d = prompt_drift_text(frag(), frag())  # fragments of 中 in one, of 是 in the other: undecided
    >>> (d["js_div"], d["js_lo"], round(d["js_hi"], 6))
    (0.0, 0.0, 0.9)
    """
    p, q = merge(a), merge(b)
    dp, dq = _definite(p), _definite(q)
    ra, rb = _ranked(p), _ranked(q)
    n = min(TOP_N, len(ra), len(rb))
    js = js if (js := stats.jsd(p, q)) >= JSD_ROUNDING else 0.0
    return {
        "top5_mass_a": sum(math.exp(t.logprob) for t in a[:TOP_N]),
        "top5_mass_b": sum(math.exp(t.logprob) for t in b[:TOP_N]),
        "top5_overlap": len(set(ra[:TOP_N]) & set(rb[:TOP_N])) / n,
        "js_div": js,
        "flipped": 1.0 if ra[0] != rb[0] else 0.0,
        "js_lo": js_bounds(js, 1 - math.fsum(dp.values()), 1 - math.fsum(dq.values()))[0],
        "js_hi": max(js, js_max(dp, dq)),
    }


@dataclass(frozen=True)
class FirstChars:
    """One prompt's stored first-character distribution (first_char_topk and its samples row): the listed
    events and probabilities, the resolved mass of the events not listed, the mass left unresolved."""

    events: Sequence[tuple[str, float]]
    rest: float = 0.0
    unresolved: float = 0.0

    def dist(self) -> dict[str, float]:
        """The listed events' probabilities, scaled down where float rounding took their sum past 1."""
        mass = dict(self.events)
        total = math.fsum(mass.values())
        return {e: p / total for e, p in mass.items()} if total > 1 else mass

    @property
    def outside(self) -> float:
        """The mass outside the listed events: their rest bucket (`stats.jsd`), resolved or not."""
        return max(0.0, 1.0 - math.fsum(self.dist().values()))


def js_bounds(js: float, outside_a: float, outside_b: float) -> tuple[float, float]:
    """Where the JSD of the two whole first-character distributions lies, given `js` computed with each
    side's mass outside its listed events as one rest bucket.

    The true distribution differs from the bucketed one only in where the bucket's mass goes, so their
    total variation is at most that mass, r; sqrt(JSD) is a metric and JSD <= total variation (base 2),
    so |sqrt(true) - sqrt(js)| <= sqrt(r_a) + sqrt(r_b).

    >>> js_bounds(0.0, 1e-4, 1e-4)
    (0.0, 0.0004)
    >>> [round(x, 4) for x in js_bounds(0.25, 0.0, 0.0)]
    [0.25, 0.25]
    """
    s = math.sqrt(max(outside_a, 0.0)) + math.sqrt(max(outside_b, 0.0))
    root = math.sqrt(max(js, 0.0))
    return round(max(0.0, root - s) ** 2, 15), round(min(1.0, (root + s) ** 2), 15)


def js_max(p: Mapping[str, float], q: Mapping[str, float]) -> float:
    """The largest JSD (base 2) two whole distributions can have when `p` and `q` list only some of their
    events, each side's unlisted mass (1 − its sum) lying anywhere: that mass on events the other side
    never has, `stats.jsd` with each side's rest as an event of its own. Exact, not a bound on a bound:
    with f(a, b) the term an event adds to the JSD, f is convex and 1-homogeneous, so
    f(a + α, b + β) <= f(a, b) + f(α, 0) + f(0, β) for any placement, which that placement reaches.
    0 below `JSD_ROUNDING`, as `js_div`.

    >>> js_max({"a": 0.5}, {"a": 0.5})  # both halves unlisted: disjoint at most
    0.5
    >>> js_max({"a": 1.0}, {"a": 1.0}), js_max({"a": 1.0}, {"b": 1.0}), js_max({}, {})
    (0.0, 1.0, 1.0)
    """
    rest_a, rest_b = max(0.0, 1.0 - math.fsum(p.values())), max(0.0, 1.0 - math.fsum(q.values()))
    top = stats.jsd({**p, _REST_A: rest_a}, {**q, _REST_B: rest_b})
    return top if top >= JSD_ROUNDING else 0.0


def _definite(mass: Mapping[str, float]) -> dict[str, float]:
    """The events of a stored top-k that name one first character; `<whitespace>` (the character follows)
    and `byte:*` (one lead byte, many characters) do not, and count as unlisted for `js_max`."""
    return {e: v for e, v in mass.items() if e != WHITESPACE and not e.startswith("byte:")}


def prompt_drift_chars(a: FirstChars, b: FirstChars) -> dict[str, float]:
    """One prompt's drift between two runs' stored first-character distributions (`prompt_drift_text`'s
    values, on the whole-vocabulary events), with `js_lo` / `js_hi`: where the JSD of the whole
    distributions lies, the mass outside the stored events (rest and unresolved) placed anywhere
    (`js_bounds`' lower bound, `js_max`).

    >>> a = FirstChars([("中", 0.7), ("A", 0.3)])
    >>> b = FirstChars([("中", 0.69995), ("A", 0.3)], unresolved=5e-5)
    >>> d = prompt_drift_chars(a, b)
    >>> (d["top5_overlap"], d["flipped"], round(d["js_div"], 6), round(d["js_hi"], 6))
    (1.0, 0.0, 2.5e-05, 2.5e-05)
    """
    p, q = a.dist(), b.dist()
    ra, rb = _ranked(p), _ranked(q)
    n = min(TOP_N, len(ra), len(rb))
    js = stats.jsd(p, q)
    js = js if js >= JSD_ROUNDING else 0.0
    lo = js_bounds(js, a.outside, b.outside)[0]
    hi = max(js, js_max(p, q))
    return {
        "top5_mass_a": math.fsum(p[e] for e in ra[:TOP_N]),
        "top5_mass_b": math.fsum(q[e] for e in rb[:TOP_N]),
        "top5_overlap": len(set(ra[:TOP_N]) & set(rb[:TOP_N])) / n if n else 0.0,
        "js_div": js,
        "flipped": 1.0 if (ra[0] if ra else None) != (rb[0] if rb else None) else 0.0,
        "js_lo": lo,
        "js_hi": hi,
        "unresolved_a": a.unresolved,
        "unresolved_b": b.unresolved,
    }


def cut(k_a: int | None, k_b: int | None) -> int | None:
    """The K both lists are cut to: the shorter of two different K's; None when they agree
    (nothing is cut) or either is unknown.

    >>> cut(50, 50), cut(3, 1), cut(None, 5)
    (None, 1, None)
    """
    if k_a is None or k_b is None or k_a == k_b:
        return None
    return min(k_a, k_b)


@dataclass(frozen=True)
class RunTokenizer:
    """What tells a run's tokenizer: its stored hash (None before m021), model fingerprint, and the
    token texts its stored top-k rows give each id (over the prompts compared)."""

    run_id: str
    hash: str | None
    fingerprint: str | None
    texts: Mapping[int, frozenset[str]]  # token id -> the texts stored for it
    source: str | None = None  # runs.tokenizer_source: "<origin>: <what was hashed>"

    @property
    def kind(self) -> str | None:
        """What the hash was computed from (`kinds.TokenizerKind`); hashes of two kinds are not comparable."""
        return self.source.rsplit(": ", 1)[-1] if self.source else None


@dataclass(frozen=True)
class Relation:
    same: bool  # token ids mean the same texts in both runs: compare by id
    why: str  # one line: how that was decided


def tokenizer_relation(a: RunTokenizer, b: RunTokenizer) -> Relation:
    """Whether runs A and B share a tokenizer.

    Both hashes stored and computed from the same kind of source: the same hash, or not. Otherwise
    (a run stored before tokenizer identities, or one tokenizer hashed from a tokenizer.json and
    the other from a GGUF vocabulary) the same non-null model fingerprint means the same tokenizer; failing that, the
    stored top-k rows decide: the same tokenizer when at least one id appears in both runs, every
    id in both has the same text(s) in both, and every text that names one id in each run names
    the same id in both (a permuted vocabulary breaks that). No shared evidence: different.

    >>> t = lambda run, h, fp, texts: RunTokenizer(run, h, fp, {k: frozenset([v]) for k, v in texts.items()})
    >>> tokenizer_relation(t("a", "h1", None, {}), t("b", "h1", None, {})).same
    True
    >>> tokenizer_relation(t("a", None, None, {1: "x", 2: "y"}), t("b", None, None, {1: "y", 2: "x"})).why
    "tokenizer unknown for run a, b: the stored top-k give token 1 the text 'x' in a and 'y' in b"
    """
    if a.hash is not None and b.hash is not None:
        if a.hash == b.hash:
            return Relation(True, f"same tokenizer ({a.hash[:12]})")
        if a.kind == b.kind:
            return Relation(False, f"different tokenizers ({a.hash[:12]} in {a.run_id}, {b.hash[:12]} in {b.run_id})")
        head = f"tokenizers hashed from different sources ({a.kind} in {a.run_id}, {b.kind} in {b.run_id})"
    else:
        unknown = ", ".join(r.run_id for r in (a, b) if r.hash is None)
        head = f"tokenizer unknown for run {unknown}"
    if a.fingerprint is not None and a.fingerprint == b.fingerprint:
        return Relation(True, f"{head}: same model fingerprint, so the same tokenizer")
    shared = sorted(set(a.texts) & set(b.texts))
    for t in shared:
        if a.texts[t] != b.texts[t]:
            return Relation(False, f"{head}: the stored top-k give token {t} the text "
                                   f"{_show(a.texts[t])} in {a.run_id} and {_show(b.texts[t])} in {b.run_id}")
    ids_a, ids_b = _single_ids(a.texts), _single_ids(b.texts)
    for text in sorted(ids_a.keys() & ids_b.keys()):
        if ids_a[text] != ids_b[text]:
            return Relation(False, f"{head}: the stored top-k give the text {text!r} token {ids_a[text]} in "
                                   f"{a.run_id} and token {ids_b[text]} in {b.run_id}")
    if not shared:
        return Relation(False, f"{head}: no token id in both runs' stored top-k to tell by")
    return Relation(True, f"{head}: the stored top-k give each of {len(shared)} shared token ids the same text")


def _show(texts: frozenset[str]) -> str:
    return repr(next(iter(texts))) if len(texts) == 1 else repr(sorted(texts))


def _single_ids(texts: Mapping[int, frozenset[str]]) -> dict[str, int]:
    """text -> id for the texts one id alone carries (byte tokens all decoding to "\ufffd" carry many)."""
    ids: dict[str, list[int]] = {}
    for t, ts in texts.items():
        for text in ts:
            ids.setdefault(text, []).append(t)
    return {text: found[0] for text, found in ids.items() if len(found) == 1}
