"""What a run computes: `evalkit run --metrics gate|all|NAME,...` read into the engine phases it needs.

Owns: `Selection` (the selection as given, the metrics it names, the engine phases they read), `parse`
(a name that matches nothing is `BadInput` listing the known names), which metrics a selection leaves
uncomputed and why (`Selection.skipped`), and the words that reason is written in, which `evalkit gate`
and `evalkit compare` read back (`NOT_COMPUTED`). The metrics themselves and the phases each reads are the
registry's (`registry.Metric.reads`); `gate` is `registry.GATE_METRICS`. Does not: run an engine (each
engine reads `Selection.runs(phase)`), or decide anything about a gate.

A metric is computed when every phase it reads runs; a phase runs for a kind of document (a first-token
prompt, a needle document ...) when a selected metric scored on that kind reads it, and the first step
always runs (every prompt needs its first token, top-k, entropy ...). So a metric that comes free with a
phase that runs anyway is kept (`--metrics gate` keeps entropy and top1_prob: the prefill gives them), and
one whose phase was skipped is NULL, with the reason in the run row. `gate` decodes the needle documents
(needle_recall reads their responses) and no first-token prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalkit.errors import BadInput
from evalkit.kinds import ENGINE_PHASES, METRIC_SETS, EnginePhase
from evalkit.scoring import registry

ALL = "all"
GATE = "gate"
NOT_COMPUTED = "not computed"  # how every skipped metric's reason begins

PHASE_WORDS: dict[str, str] = {  # phase -> what it is, as a reason names it
    "first_step": "the first-step distribution",
    "start_trie": "the candidate trie of the accepted answer starts",
    "answer_trie": "the candidate trie of the checkable answers",
    "opener_trie": "the candidate trie of the opener lexicon",
    "units": "the first units of the likeliest first tokens",
    "response": "the greedy response",
    "answer": "the answer continuation",
}
assert set(PHASE_WORDS) == set(ENGINE_PHASES), "a phase without words"


@dataclass(frozen=True)
class Selection:
    """A run's `--metrics`: the text as given, the registry metrics it names, the phases that run."""

    spec: str  # as the run row stores it: "all", "gate", "ft_hit_prob,js_div"
    metrics: frozenset[str]  # registry names (a family by its registry name: needle_recall@depth{D})
    phases: frozenset[str]  # EnginePhase members that run for some kind of document (`runs`: for one kind)

    @property
    def everything(self) -> bool:
        return self.phases == frozenset(ENGINE_PHASES)

    def runs(self, phase: EnginePhase, doc: str | None = None) -> bool:
        """Whether `phase` runs for a document of kind `doc` (`contract.DOC_KINDS`; None: a document of some
        other task, lm-eval's gsm8k say, whose own metrics read its response: that always runs for it)."""
        if self.everything or phase == "first_step":
            return True
        if doc is None and phase == "response":
            return True
        return any(phase in m.reads and m.doc in (doc, None)
                   for m in (registry.METRICS[name] for name in self.metrics))

    def computes(self, name: str) -> bool:
        """Whether the run computes metric `name` (a registry name or a family member); an unknown name is
        computed (nothing here skips what the registry does not know: lm-eval's own tasks' metrics)."""
        metric = registry.get(name)
        return metric is None or all(self.runs(p, metric.doc) for p in metric.reads)

    def skipped(self) -> dict[str, str]:
        """{registry metric: why it is NULL} for every metric this selection leaves uncomputed ({} for all)."""
        out = {}
        for metric in registry.all_metrics():
            missing = [p for p in metric.reads if not self.runs(p, metric.doc)]
            if missing:
                out[metric.name] = (f"{NOT_COMPUTED}: --metrics {self.spec} skips "
                                    f"{' and '.join(PHASE_WORDS[p] for p in missing)}")
        return out


def _phases(metrics: frozenset[str]) -> frozenset[str]:
    return frozenset({"first_step"} | {p for name in metrics for p in registry.METRICS[name].reads})


EVERYTHING = Selection(ALL, frozenset(registry.METRICS), frozenset(ENGINE_PHASES))


def known_names() -> list[str]:
    """What `--metrics` takes: the named sets, then every registry metric."""
    return [*METRIC_SETS, *registry.METRICS]


def parse(text: str | None) -> Selection:
    """`--metrics` as given (None: all) -> `Selection`; raises `BadInput` naming a name that matches nothing.

    `gate` is what the gate's default rules read (`registry.GATE_METRICS`); `all` every metric and every
    phase, the first units included (no metric reads them: the report shows them beside the top-k). Items
    are comma-separated and may mix sets and metric names; a name given twice counts once.

    >>> s = parse("gate")
    >>> sorted(s.phases), s.computes("answer_hit"), s.computes("entropy")
    (['answer_trie', 'first_step', 'response', 'start_trie'], False, True)
    >>> parse("ft_hit_prob,needle_recall@depth0.5").spec, sorted(parse("ft_hit_prob").phases)
    ('ft_hit_prob,needle_recall@depth0.5', ['first_step', 'start_trie'])
    >>> parse(None).everything, parse("all,gate").everything
    (True, True)
    """
    if text is None:
        return EVERYTHING
    items = list(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    if not items:
        raise BadInput(f"--metrics is empty: give {', '.join(METRIC_SETS)} or metric names")
    if ALL in items:
        return EVERYTHING if items == [ALL] else Selection(",".join(items), EVERYTHING.metrics, EVERYTHING.phases)
    names: set[str] = set()
    for item in items:
        if item == GATE:
            names.update(registry.GATE_METRICS)
            continue
        metric = registry.get(item)
        if metric is None:
            known = known_names()
            raise BadInput(f"--metrics: unknown metric {item!r}{registry.suggest(item, known)} "
                           f"(known: {', '.join(known)})")
        names.add(metric.name)
    frozen = frozenset(names)
    return Selection(",".join(items), frozen, _phases(frozen))


@dataclass(frozen=True)
class Candidates:
    """One first-token prompt's candidate strings, each set empty where the selection skips its trie."""

    starts: tuple[str, ...] = ()  # the accepted starts as ft_hit_prob scores them (`candidate_strings`)
    answers: tuple[str, ...] = ()  # the checkable answers as answer_prob scores them (`answer_strings`)
    openers: tuple[str, ...] = ()  # the opener lexicon's entries (opener_mass)

    @property
    def exact(self) -> list[str]:
        """The strings always scored exactly (never left out under a trie tolerance): starts, then answers."""
        return list(dict.fromkeys(self.starts + self.answers))

    @property
    def strings(self) -> list[str]:
        """Every string the trie scores: the exact ones, then the openers."""
        return self.exact + list(self.openers)


def candidates(chosen: Selection, doc: dict, openers: list[str]) -> Candidates:
    """The candidate strings a first-token prompt's trie scores under `chosen` (none for any other doc,
    or a prompt without accepted starts).

    >>> doc = {"kind": "firsttoken", "answers": ["Paris"], "answers_full": ["Paris"]}
    >>> c = candidates(parse("ft_hit_prob"), doc, ["Sure"])
    >>> c.strings, candidates(EVERYTHING, doc, ["Sure"]).strings
    (['Paris'], ['Paris', 'Sure'])
    """
    from evalkit.contract import FIRSTTOKEN, doc_kind
    from evalkit.scoring.firsttoken import answer_strings, candidate_strings

    if doc_kind(doc) != FIRSTTOKEN or not doc.get("answers"):
        return Candidates()
    return Candidates(
        starts=tuple(candidate_strings(doc["answers"])) if chosen.runs("start_trie", FIRSTTOKEN) else (),
        answers=tuple(answer_strings(doc.get("answers_full") or [])) if chosen.runs("answer_trie", FIRSTTOKEN)
        else (),
        openers=tuple(openers) if chosen.runs("opener_trie", FIRSTTOKEN) else (),
    )
