"""Fuzz: the gate's rules file (`release.rules.load_rules`) on generated YAML, text and bytes.

Every case ends in `Rules` or one BadInput line naming the file, the file keeps its bytes, and a
rule that was read means what it shows: its number is the number written."""

from __future__ import annotations

import math

import yaml
from hypothesis import given
from hypothesis import strategies as st

from evalkit.errors import BadInput
from evalkit.release.rules import Rules, load_rules
from evalkit.scoring import registry
from tests.fuzz import fingerprint, fuzz, one_line

METRICS = ["ft_hit", "ft_hit_prob", "opener_rate", "entropy", "sink_rate", "my_metric", "needle_recall@depth0.5"]
keys = st.one_of(st.sampled_from(METRICS), st.builds(lambda t, m: f"{t}/{m}", st.sampled_from(["t", "zh", "a b"]),
                                                      st.sampled_from(METRICS)), st.text(max_size=12))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**30, 10**30),
                    st.sampled_from(["0_5", "1e308", "1e400", ".5", "5.", "0x10", "010", "1:30", "+.inf", ".nan",
                                     "1_0", "yes", "off", "default", "0.02", "-0.0", "２"]))
ops = st.sampled_from([">=", ">", "<=", "<", "==", "=>", "!=", ""])
comparisons = st.builds(lambda op, n, pad: f"{op}{pad}{n}", ops, numbers.map(str), st.sampled_from(["", " ", "  "]))
margins = st.one_of(numbers, st.dictionaries(st.sampled_from(["delta", "relative", "ratio"]), numbers, max_size=2))
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=8))
documents = st.fixed_dictionaries({}, optional={
    "thresholds": st.one_of(st.dictionaries(keys, st.one_of(comparisons, scalars), max_size=4), scalars),
    "regressions": st.one_of(st.dictionaries(keys, margins, max_size=4), scalars),
    "higher_is_better": st.one_of(st.dictionaries(keys, st.one_of(st.booleans(), scalars), max_size=3), scalars),
    "extra": scalars,
})


def _yaml_text(doc: dict) -> str:
    """The document as YAML, with numbers-as-text written plain (unquoted), as a user would type them."""
    lines = []
    for section, body in doc.items():
        if not isinstance(body, dict):
            lines.append(f"{section}: {_plain(body)}")
            continue
        lines.append(f"{section}:")
        for key, value in body.items():
            if isinstance(value, dict):
                value = "{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}"
            elif section == "thresholds" and isinstance(value, str):
                value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                value = _plain(value)
            lines.append(f"  {_key(key)}: {value}")
    return "\n".join(lines) + "\n"


def _plain(value) -> str:
    if isinstance(value, str):
        return value if value and value.isprintable() and value.strip() == value and ":" not in value[:-1] \
            and not value.startswith(("{", "[", "&", "*", "!", "|", ">", "#", "%", "@", "`", "'", '"', "-", "?")) \
            else yaml.safe_dump(value, default_style='"').strip()
    return yaml.safe_dump(value).strip().removesuffix("...").strip()


def _key(key: str) -> str:
    return yaml.safe_dump(key, default_style='"').strip() if not key.replace("/", "").replace("_", "").replace(
        "@", "").replace(".", "").isalnum() else key


def _check(path, before) -> Rules | None:
    try:
        rules = load_rules(path)
    except BadInput as exc:
        one_line(exc)
        assert str(path) in str(exc)
        rules = None
    except Exception as exc:  # noqa: BLE001 - any other exception is a finding
        one_line(exc)
        raise
    assert fingerprint(path) == before
    return rules


@fuzz(150)
@given(doc=documents)
def test_generated_rules_documents(tmp_path_factory, doc):
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    text = _yaml_text(doc)
    path.write_text(text, encoding="utf-8")
    rules = _check(path, fingerprint(path))
    if rules is None:
        return
    for rule in rules.thresholds:  # a comparison read is the number written, finite
        assert math.isfinite(rule.value)
        written = doc["thresholds"][rule.key]
        assert float(written.lstrip("<>=! ")) == rule.value
        span = registry.value_range(rule.metric)  # and a bound the metric can reach
        assert span is None or span[0] <= rule.value and (span[1] is None or rule.value <= span[1])
    for rule in rules.regressions:
        assert math.isfinite(rule.margin.value) and rule.margin.value >= 0
        span = registry.value_range(rule.metric)
        assert rule.margin.kind != "delta" or span is None or span[1] is None or rule.margin.value <= span[1] - span[0]


@fuzz(150)
@given(data=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_arbitrary_bytes_as_a_rules_file(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_bytes(data)
    _check(path, fingerprint(path))


@fuzz(60)
@given(head=st.sampled_from(["thresholds:\n  ft_hit: ", "regressions:\n  ft_hit: ", "higher_is_better:\n  my: "]),
       value=st.text(alphabet="0123456789._-+eExo:\"' ><=!&*[]{}|#%@\\\n\t", max_size=20))
def test_yaml_scalars_under_every_section(tmp_path_factory, head, value):
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(head + value + "\n", encoding="utf-8")
    _check(path, fingerprint(path))
