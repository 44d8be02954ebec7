"""`evalkit-vllm` (evalkit/probe_vllm.py) against a fake `vllm` package; `--model vllm` without vllm.

vllm cannot be installed here (no GPU), so `fake_vllm` writes a package named
`vllm` (with a dist-info, since lm-eval reads `version("vllm")`) into a tmp folder
on sys.path. It provides what lm_eval.models.vllm_causallms imports (LLM,
SamplingParams, TokensPrompt, vllm.lora.request.LoRARequest, get_tokenizer,
resolve_hf_chat_template) in the shapes of vLLM >= 0.9: `LLM.generate` returns
RequestOutput-like objects whose `outputs[0]` has `.text`, `.token_ids` and
`.logprobs`, one {token_id: Logprob(logprob, rank, decoded_token)} per generated
token, the sampled token first and then ranks 1..n (vllm/logprobs.py). Behind
the fake LLM runs the tiny random Llama through transformers, so the logprobs are
a real model's, and the test checks them against a plain
`log_softmax(model(ids).logits[0, -1])`. What the fake cannot show: that a real
vLLM engine returns raw (T = 1) logprobs and honours max_logprobs as documented.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evalkit.contract import FirstStepResult

FAKE_VERSION = "0.11.0"

FAKE_INIT = '''
"""A fake vllm: the names lm-eval's VLLM uses, run on a transformers model. Test-only."""
import math
from typing import TypedDict

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

__version__ = "{version}"
CALLS = []  # (prompt_token_ids, SamplingParams) of every generate call
ENGINES = []


class TokensPrompt(TypedDict):
    prompt_token_ids: list


class SamplingParams:
    _FIELDS = dict(
        n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=None, stop_token_ids=None,
        ignore_eos=False, max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True,
        skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
        presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
    )

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self._FIELDS)
        if unknown:  # vLLM's SamplingParams is a msgspec struct: unknown fields are an error
            raise TypeError(f"SamplingParams got unexpected arguments {{sorted(unknown)}}")
        for key, default in self._FIELDS.items():
            setattr(self, key, kwargs.get(key, default))
        if self.temperature < 1e-5:  # vLLM: greedy
            self.temperature = 0.0


class _ModelConfig:
    def __init__(self, max_model_len, max_logprobs):
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs


class _Engine:
    def __init__(self, model_config):
        self.model_config = model_config


class LLM:
    def __init__(self, model, seed=0, max_model_len=None, max_logprobs=20, **kwargs):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.hf = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tok = AutoTokenizer.from_pretrained(model)
        self.seed = seed
        self.args = dict(model=model, seed=seed, max_model_len=max_model_len, max_logprobs=max_logprobs, **kwargs)
        self.llm_engine = _Engine(_ModelConfig(max_model_len or 2048, max_logprobs))
        self.torch = torch
        ENGINES.append(self)

    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        cap = self.llm_engine.model_config.max_logprobs
        out = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            CALLS.append((list(prompt["prompt_token_ids"]), sp))
            if sp.logprobs is not None and cap != -1 and sp.logprobs > cap:
                raise ValueError(f"Requested sample logprobs of {{sp.logprobs}}, which is greater than max allowed: {{cap}}")
            out.append(self._complete(str(i), list(prompt["prompt_token_ids"]), sp))
        return out

    def _complete(self, request_id, prompt_ids, sp):
        torch = self.torch
        gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else self.seed)
        ids, new, steps, text, reason = list(prompt_ids), [], [], "", "length"
        for _ in range(sp.max_tokens):
            with torch.no_grad():
                logits = self.hf(torch.tensor([ids])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            if sp.temperature == 0.0:
                token = int(torch.argmax(logits))
            else:
                token = int(torch.multinomial(torch.softmax(logits / sp.temperature, -1), 1, generator=gen))
            if sp.logprobs is not None:
                n = logprobs.numel() if sp.logprobs == -1 else sp.logprobs
                rank = 1 + int((logprobs > logprobs[token]).sum())
                step = {{token: Logprob(float(logprobs[token]), rank, self.tok.decode([token]))}}
                top = torch.topk(logprobs, n)
                for r, (t, lp) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                    step[t] = Logprob(lp, r, self.tok.decode([t]))
                steps.append(step)
            ids.append(token)
            new.append(token)
            text = self.tok.decode(new, skip_special_tokens=sp.skip_special_tokens)
            hits = [text.index(s) for s in (sp.stop or []) if s and s in text]
            if hits:
                text, reason = text[: min(hits)], "stop"
                break
            if token == self.tok.eos_token_id and not sp.ignore_eos:
                reason = "stop"
                break
        completion = CompletionOutput(0, text, new, None, steps if sp.logprobs is not None else None, reason)
        return RequestOutput(request_id, None, prompt_ids, None, [completion], True)
'''

FAKE_FILES = {
    "vllm/logprobs.py": '''
from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
''',
    "vllm/outputs.py": '''
from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list | None
    prompt_logprobs: list | None
    outputs: list
    finished: bool
''',
    "vllm/lora/__init__.py": "",
    "vllm/lora/request.py": '''
class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path=""):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
''',
    "vllm/tokenizers.py": '''
def get_tokenizer(name, tokenizer_mode="auto", trust_remote_code=False, revision=None, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, revision=revision, **kwargs)
''',
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/chat_utils.py": '''
def resolve_hf_chat_template(tokenizer, chat_template=None, tools=None, model_config=None, **kwargs):
    return chat_template or getattr(tokenizer, "chat_template", None)
''',
}

GREEDY = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
SAMPLED = {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": True, "temperature": 0.8}
DOCS = [
    {"kind": "firsttoken", "id": "en-1", "prompt": "What is the capital of France?", "answers": ["Paris"], "lang": "en"},
    {"kind": "firsttoken", "id": "zh-1", "prompt": "中国的首都是哪里？", "answers": ["北京"], "lang": "zh"},
    {"kind": "firsttoken", "id": "en-2", "prompt": "What is recursion?", "answers": ["Recursion"], "lang": "en"},
]


def write_fake_vllm(root: Path) -> Path:
    """Write the fake `vllm` package and its dist-info under root; return root."""
    files = {"vllm/__init__.py": FAKE_INIT.format(version=FAKE_VERSION), **FAKE_FILES}
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    info = root / f"vllm-{FAKE_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {FAKE_VERSION}\n", encoding="utf-8")
    return root


def _ours(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.") or name in ("lm_eval.models.vllm_causallms", "evalkit.engines.vllm.model")


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The fake vllm importable for one test; afterwards sys.modules, sys.path and lm-eval's
    model registry are as before (so a later test sees vllm not installed again)."""
    import lm_eval.models  # noqa: F401  (fills the lazy registry before the snapshot)
    from lm_eval.api.registry import model_registry

    registry = dict(model_registry._objs)
    root = write_fake_vllm(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    vllm = importlib.import_module("vllm")
    yield vllm
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    model_registry._objs.clear()
    model_registry._objs.update(registry)
    monkeypatch.undo()
    importlib.invalidate_caches()


@pytest.fixture
def make_lm(fake_vllm, tiny_model_dir):
    """make_lm(**model_args) -> an `evalkit-vllm` LM on the tiny model, built as the runner builds it."""
    from evalkit.engines.resolve import model_class

    def make(**args):
        cls = model_class("vllm")
        return cls.create_from_arg_obj({"pretrained": str(tiny_model_dir), **args}, {"batch_size": 2, "device": None})

    return make


def _requests(lm, gen_kwargs_list, docs=DOCS):
    from lm_eval.api.instance import Instance

    out = []
    for i, (doc, gen) in enumerate(zip(docs, gen_kwargs_list)):
        context = lm.apply_chat_template([{"role": "user", "content": doc["prompt"]}])
        out.append(Instance("generate_until", doc, (context, dict(gen)), i))
    return out


def _reference(tiny_model_dir, context: str, k: int):
    """(top-k [(id, logprob)], full log-softmax) of the first step, by a plain forward of the tiny model."""
    import torch

    from tests.tiny import load_tiny

    model, tok = load_tiny(tiny_model_dir)
    ids = tok(context, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    top = torch.topk(logprobs, k)
    return list(zip(top.indices.tolist(), top.values.tolist())), logprobs


# -- the pure conversion -------------------------------------------------------------


def test_first_step_result_from_logprobs(fake_vllm):
    from vllm.logprobs import Logprob

    from evalkit.engines.vllm.model import first_step_result

    # as vLLM builds a position: the sampled token first, then ranks 1..n
    step0 = {11: Logprob(-0.5, 1, "A"), 12: Logprob(-1.5, 2, "B"), 13: Logprob(-2.0, 3, "C"), 14: Logprob(-3.0, 4, "D")}
    pieces = {11: "A", 12: "B", 13: "C", 14: "D", 15: " e"}

    def decode(ids, skip_special_tokens):
        return "".join(pieces[i] for i in ids)

    out = first_step_result("A e", [11, 15], [step0, {15: Logprob(-0.1, 1, " e")}],
                            k=3, temperature=1.0, decode=decode, answer_first_ids={11})
    assert isinstance(out, FirstStepResult)
    assert out.topk == [(11, "A", -0.5), (12, "B", -1.5), (13, "C", -2.0)]  # K=3 cuts rank 4
    assert out.first_token_id == 11 and out.first_token == "A" and out.first_unit == "A"
    assert out.entropy is None
    top3 = math.exp(-0.5) + math.exp(-1.5) + math.exp(-2.0)
    assert out.metrics == pytest.approx({"top3_mass": top3, "unstable": 1.0 if top3 < 0.7 else 0.0, "ft_token_hit": 1.0})

    # at T != 1 the top-K logprobs do not fix top3_mass@T: left out, with `unstable`
    at_08 = first_step_result("A e", [11, 15], [step0], k=3, temperature=0.8, decode=decode, answer_first_ids={12})
    assert at_08.metrics == {"ft_token_hit": 0.0}
    # no accepted starts (a needle doc): no ft_token_hit; no logprobs at all: empty top-k, no metrics
    assert "ft_token_hit" not in first_step_result("A", [11], [step0], k=3, temperature=1.0, decode=decode).metrics
    empty = first_step_result("", [], None, k=20, temperature=1.0, decode=decode, answer_first_ids={11})
    assert empty.topk == [] and empty.metrics == {} and empty.first_token_id is None
    # a completion that is only the eos vLLM keeps: no first token, as evalkit-hf stores it
    only_eos = first_step_result("", [14], [step0], k=3, temperature=1.0, decode=decode, eos_ids={14})
    assert only_eos.first_token_id is None and only_eos.first_token == "" and len(only_eos.topk) == 3


def test_topk_is_ordered_by_rank_with_the_sampled_token_out_of_the_top(fake_vllm):
    from vllm.logprobs import Logprob

    from evalkit.engines.vllm.model import step_topk

    # a sampled (non-argmax) token of rank 7 comes first in vLLM's dict; it is not in the top 3
    step = {40: Logprob(-4.0, 7, "x"), 1: Logprob(-0.2, 1, "a"), 2: Logprob(-1.9, 2, "b"), 3: Logprob(-2.5, 3, "c")}
    assert step_topk(step, 3) == [(1, -0.2), (2, -1.9), (3, -2.5)]


def test_logprobs_k_is_capped_by_vllms_max_logprobs(fake_vllm):
    from evalkit.engines.vllm.resolve import VLLM_MAX_LOGPROBS, logprobs_k

    assert VLLM_MAX_LOGPROBS == 20
    assert logprobs_k(50, None) == 20  # engine not known: vLLM's default
    assert logprobs_k(50, 20) == 20 and logprobs_k(50, 64) == 50 and logprobs_k(50, -1) == 50


# -- the subclass on the fake engine -------------------------------------------------


def test_greedy_requests_return_the_probe_dict_with_top20(make_lm, tiny_model_dir, fake_vllm):
    lm = make_lm(top_k=50, temperature=1.0)
    assert lm.logprobs_k == 20  # vLLM's max_logprobs default caps the 50 asked for
    reqs = _requests(lm, [GREEDY] * len(DOCS))
    out = lm.generate_until(reqs)

    asked = [sp for _, sp in fake_vllm.CALLS]
    assert asked and all(sp.logprobs == 20 and sp.temperature == 0.0 for sp in asked)
    plain = type(lm).__mro__[1].generate_until(lm, _requests(lm, [GREEDY] * len(DOCS)))  # VLLM's own, for the text
    for req, res, text in zip(reqs, out, plain):
        assert isinstance(res, FirstStepResult)
        assert res.text == text
        top, logprobs = _reference(tiny_model_dir, req.args[0], 20)
        assert [t for t, _, _ in res.topk] == [t for t, _ in top]
        assert [lp for _, _, lp in res.topk] == pytest.approx([lp for _, lp in top], abs=1e-5)
        assert res.first_token_id == top[0][0]
        assert res.topk[0][1] == lm.tokenizer.decode([top[0][0]], skip_special_tokens=False)
        assert res.metrics["top3_mass"] == pytest.approx(float(logprobs.exp().sort(descending=True).values[:3].sum()), abs=1e-5)
        assert res.metrics["unstable"] == (1.0 if res.metrics["top3_mass"] < 0.70 else 0.0)
        assert res.entropy is None
        assert not {"entropy", "ft_hit_prob", "opener_mass", "prior_drift"} & set(res.metrics)
        from evalkit.engines.transformers import firststep as engine

        firsts = {engine.candidate_ids(lm.tokenizer, req.args[0], a)[0] for a in req.doc["answers"]}
        assert res.metrics["ft_token_hit"] == (1.0 if top[0][0] in firsts else 0.0)


def test_agrees_with_evalkit_hf_where_both_are_exact(make_lm, tiny_model_dir):
    """Same model, same contexts: the vLLM result equals evalkit-hf's on every field vLLM fills."""
    from evalkit.engines.transformers.model import EvalkitHFLM

    lm = make_lm(top_k=50, temperature=1.0)
    reqs = _requests(lm, [GREEDY] * len(DOCS))
    ours = lm.generate_until(reqs)
    hf = EvalkitHFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=1, top_k=50, temperature=1.0)
    theirs = hf.generate_until(_requests(lm, [GREEDY] * len(DOCS)), disable_tqdm=True)
    for a, b in zip(ours, theirs):
        assert type(a) is type(b) is FirstStepResult
        for key in ("text", "first_token_id", "first_token", "first_unit"):
            assert getattr(a, key) == getattr(b, key), key
        assert [row[:2] for row in a.topk] == [row[:2] for row in b.topk[:20]]
        assert [row[2] for row in a.topk] == pytest.approx([row[2] for row in b.topk[:20]], abs=1e-5)
        for metric, value in a.metrics.items():
            assert value == pytest.approx(b.metrics[metric], abs=1e-5), metric


def test_engine_max_logprobs_raises_k_and_temperature_drops_top3(make_lm, fake_vllm):
    lm = make_lm(top_k=50, temperature=0.8, max_logprobs=64)
    assert lm.logprobs_k == 50
    res = lm.generate_until(_requests(lm, [GREEDY]))[0]
    assert len(res.topk) == 50
    assert "top3_mass" not in res.metrics and "unstable" not in res.metrics
    assert "ft_token_hit" in res.metrics


def test_sampled_requests_go_to_vllm_unchanged(make_lm, fake_vllm):
    lm = make_lm(top_k=50, temperature=1.0)
    reqs = _requests(lm, [SAMPLED, GREEDY, SAMPLED])
    out = lm.generate_until(reqs)
    assert isinstance(out[0], str) and isinstance(out[2], str)
    assert isinstance(out[1], FirstStepResult) and len(out[1].topk) == 20
    by_prompt = {tuple(ids): sp for ids, sp in fake_vllm.CALLS}
    for req in (reqs[0], reqs[2]):
        sp = by_prompt[tuple(lm.tok_encode(req.args[0]))]
        assert sp.logprobs is None and sp.temperature == 0.8 and sp.max_tokens == 4
    # the same sampled requests through VLLM's own generate_until give the same strings (same seed)
    again = type(lm).__mro__[1].generate_until(lm, [reqs[0], reqs[2]])
    assert again == [out[0], out[2]]


def test_first_step_result_scores_and_collects(make_lm):
    from evalkit.scoring.firsttoken import score, stored_fields
    from evalkit.scoring.lexicon import load_lexicon

    lm = make_lm(top_k=50, temperature=1.0)
    res = lm.generate_until(_requests(lm, [GREEDY]))[0]
    values, fields = score(DOCS[0], res, load_lexicon().entries), stored_fields(res)
    assert {"ft_hit", "opener_rate", "ft_token_hit", "top3_mass", "unstable"} <= set(values)
    assert "entropy" not in values
    assert fields["topk"] == res.topk and fields["first_token_id"] == res.first_token_id


def test_evalkit_run_model_vllm_end_to_end(fake_vllm, tiny_model_dir, tmp_path):
    """`evalkit run --model vllm` on the fake engine: 20 top-k rows per prompt, no entropy, exact top3 at T=1."""
    from click.testing import CliRunner

    from evalkit.cli import cli
    from evalkit.store import db as store_db

    db = tmp_path / "vllm.duckdb"
    args = ["run", "--model", "vllm", "--model-args", f"pretrained={tiny_model_dir}", "--tasks", "firsttoken_en",
            "--limit", "2", "--temperature", "1", "--db", str(db)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with store_db.open_reader(db) as con:
        model, status, top_k = con.execute("SELECT model, status, top_k FROM runs").fetchone()
        rows = con.execute("SELECT doc_id, count(*) FROM first_token_topk GROUP BY doc_id").fetchall()
        samples = con.execute("SELECT top3_mass, entropy, ft_token_hit, first_token_id FROM samples").fetchall()
    assert (model, status, top_k) == ("vllm", "done", 20)  # what was stored, not the 50 asked for
    assert len(rows) == 2 and all(n == 20 for _, n in rows)
    assert all(t is not None and e is None and h is not None and f is not None for t, e, h, f in samples)


# -- without vllm ----------------------------------------------------------------------


def test_model_vllm_without_vllm_is_bad_input_and_leaves_the_db(tmp_path):
    """vllm is not installed here: one line, exit 2, before any run row is written."""
    import importlib.util

    from click.testing import CliRunner

    from evalkit.cli import cli
    from evalkit.store import db as store_db

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    db = tmp_path / "evalkit.duckdb"
    with store_db.open_writer(db):
        pass
    before = db.read_bytes()
    for model in ("vllm", "evalkit-vllm"):
        args = ["run", "--model", model, "--model-args", "pretrained=Qwen/Qwen2.5-0.5B-Instruct",
                "--tasks", "firsttoken", "--db", str(db)]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2, result.output
        assert len(lines) == 1 and lines[0].startswith("evalkit: error: ") and "'vllm'" in lines[0], result.stderr
        assert "pip install vllm" in lines[0]
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evalkit.duckdb"]


def test_model_vllm_needs_pretrained_and_refuses_hf_only_options(fake_vllm, tmp_path):
    from click.testing import CliRunner

    from evalkit.cli import cli

    db = tmp_path / "evalkit.duckdb"
    cases = [
        (["--model", "vllm", "--tasks", "firsttoken"], "pretrained="),
        (["--model", "vllm", "--model-args", "pretrained=m", "--tasks", "firsttoken", "--ban-openers"], "hf backend"),
        (["--model", "vllm", "--model-args", "pretrained=m", "--tasks", "firsttoken", "--first-temperature", "0"],
         "hf backend"),
    ]
    for argv, expect in cases:
        result = CliRunner().invoke(cli, ["run", *argv, "--db", str(db)], catch_exceptions=False)
        assert result.exit_code == 2 and expect in result.stderr, result.output
    assert not db.exists()


def test_help_imports_neither_vllm_nor_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from evalkit.cli import cli\n"
        "assert CliRunner().invoke(cli, ['run', '--help']).exit_code == 0\n"
        "import evalkit.engines.resolve, evalkit.engines.catalog\n"
        "bad = [m for m in ('vllm', 'torch', 'lm_eval.models.vllm_causallms', 'evalkit.engines.vllm.model') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
