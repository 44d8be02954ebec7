"""The one door from text to tokens (evalkit/prompts/encoding.py): the special tokens a tokenizer declares,
fed once, on every engine and template; `add_bos_token` overrides; templates with lm-eval's doc_to_text."""

from __future__ import annotations

import pytest

from evalkit.engines.modelid import gguf_add_bos
from evalkit.errors import BadInput
from evalkit.prompts import encoding
from evalkit.prompts.templates import Template, get_template, load_templates, render_prompt
from tests import gemma

# the chat templates that spell the BOS themselves (abridged from the models' own, the BOS line as theirs)
LLAMA3_CHAT = ("{{- bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
              "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_the_tiny_tokenizer_declares_nothing_and_its_ids_are_the_texts_own(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert encoding.declared_prefix(tok) == ()
    text = "What is the capital of France?"
    assert encoding.encode(tok, text) == tok(text, add_special_tokens=False)["input_ids"]
    assert encoding.feed_of(tok).describe() == "nothing, declared by the tokenizer"
    assert encoding.feed_of(tok).note() is None


def _gguf_add_bos(family: str) -> bool | None:
    """What the family's vocabulary GGUF says in `tokenizer.ggml.add_bos_token` (None: nothing)."""
    import gguf

    from tests import zoo as zoo_module

    field = gguf.GGUFReader(str(zoo_module.vocab_dir() / f"ggml-vocab-{family}.gguf")).fields.get(
        "tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.parts[field.data[0]][0])


@pytest.mark.parametrize("family", ["llama-spm", "llama-bpe", "qwen2", "phi-3", "gemma-4"])
def test_the_declaration_read_from_the_tokenizer_is_the_ggufs_own(family):
    """`declared_prefix` reads what the tokenizer transformers builds from the GGUF adds; it says what the file
    itself declares (Llama 2 and Phi-3: a BOS; this Llama 3 and Qwen2 vocabulary: none)."""
    from tests import zoo as zoo_module

    reason = zoo_module.missing(family)
    if reason:
        pytest.skip(reason)
    tok = zoo_module.load_tokenizer(family)
    says = gguf_add_bos(zoo_module.vocab_dir() / f"ggml-vocab-{family}.gguf")
    assert says is _gguf_add_bos(family)
    expected = (tok.bos_token_id,) if says else ()
    if family != "gemma-4":  # transformers' conversion keeps the declaration, save gemma-4's
        assert encoding.declared_prefix(tok) == expected
    else:
        assert encoding.declared_prefix(tok) == () and says, "gemma-4: the file declares what transformers drops"
    feed = encoding.set_feed(tok, None, gguf_add_bos=says)  # what the hf engine fixes for a GGUF it loads
    assert feed.prefix == expected and feed.note() is None


@pytest.mark.parametrize("family,template", [("llama-bpe", LLAMA3_CHAT), ("llama-spm", GEMMA_CHAT),
                                             ("phi-3", None)])
def test_a_declared_bos_is_fed_once_whether_or_not_the_chat_template_spells_it(family, template):
    from tests import zoo as zoo_module

    reason = zoo_module.missing(family)
    if reason:
        pytest.skip(reason)
    tok = zoo_module.load_tokenizer(family)
    bos = tok.bos_token_id
    encoding.set_feed(tok, True if family == "llama-bpe" else None)  # this Llama 3 vocabulary declares none
    plain = encoding.encode(tok, "What is the capital of France?")
    assert plain[0] == bos and plain.count(bos) == 1
    assert plain[1:] == tok("What is the capital of France?", add_special_tokens=False)["input_ids"]
    # where the feed is the declaration: what the tokenizer itself adds with its special tokens, the same ids
    if family != "llama-bpe":
        assert plain == tok("What is the capital of France?", add_special_tokens=True)["input_ids"][: len(plain)]
    if template is not None:
        tok.chat_template = template
        text = render_prompt(tok, Template("chat", True, None), "What is the capital of France?")
        assert text.startswith(tok.bos_token)
        ids = encoding.encode(tok, text)
        assert ids[0] == bos and ids.count(bos) == 1, "a chat template that spells the BOS gets no second one"


def test_add_bos_token_overrides_the_declaration_and_says_so(zoo):
    from tests import zoo as zoo_module

    reason = zoo_module.missing("llama-spm")
    if reason:
        pytest.skip(reason)
    tok = zoo_module.load_tokenizer("llama-spm")
    bos = tok.bos_token_id
    off = encoding.set_feed(tok, False)
    assert encoding.encode(tok, "Paris")[0] != bos
    assert off.describe().startswith("nothing, add_bos_token=false")
    assert "leaves it out" in off.note()
    on = encoding.set_feed(tok, True)
    assert encoding.encode(tok, "Paris")[0] == bos and on.note() is None
    assert (off.asked, on.asked, encoding.set_feed(tok).asked) == (False, True, None)  # what corpus mode reads
    assert on.describe().startswith(f"{tok.bos_token} (id {bos}), add_bos_token=true")


def test_add_bos_token_true_on_a_tokenizer_that_declares_none_feeds_its_bos(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    feed = encoding.set_feed(tok, True)
    assert encoding.encode(tok, "Paris")[0] == tok.bos_token_id
    assert "not the declared" in feed.note()


@pytest.mark.parametrize("value,expected", [(None, None), (True, True), ("true", True), ("False", False), ("0", False)])
def test_add_bos_token_reads_lm_evals_words(value, expected):
    assert encoding.parse_add_bos(value) is expected


def test_add_bos_token_that_is_not_a_boolean_is_one_line_and_exit_2(invoke, tmp_path):
    res = invoke("run", "--model", "hf", "--model-args", "add_bos_token=maybe", "--tasks", "firsttoken",
                 "--limit", "1", "--db", tmp_path / "x.duckdb")
    assert res.exit_code == 2
    assert "add_bos_token=maybe: expected true or false" in res.output
    assert not (tmp_path / "x.duckdb").exists()


def test_the_qa_template_says_it_in_lm_evals_words():
    qa = get_template("qa")
    assert (qa.chat, qa.doc_to_text, qa.target_delimiter) == (False, "Question: {{prompt}}\nAnswer:", " ")
    assert render_prompt(None, qa, "Who painted the Mona Lisa?") == "Question: Who painted the Mona Lisa?\nAnswer:"


@pytest.mark.parametrize("body,words", [
    ("chat: false\n  doc_to_txt: 'Q: {{prompt}}'", "unknown key 'doc_to_txt'"),
    ("chat: false\n  doc_to_text: 'Q: {{question}}'", "must use {{prompt}}"),
    ("chat: false\n  doc_to_text: 'Q: {{prompt'", "not a valid Jinja template"),
    ("chat: false\n  doc_to_text: 'Q: {{prompt}}'\n  target_delimiter: ' => '", "must be whitespace"),
])
def test_a_templates_file_that_says_something_unknown_is_refused(tmp_path, invoke, body, words):
    path = tmp_path / "t.yaml"
    path.write_text(f"mine:\n  {body}\n", encoding="utf-8")
    with pytest.raises(BadInput, match=words.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        load_templates(path)
    res = invoke("run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--limit", "1", "--templates-file", path,
                 "--template", "mine", "--db", tmp_path / "x.duckdb")
    assert res.exit_code == 2
    assert words in res.output
    assert not (tmp_path / "x.duckdb").exists()


def test_a_template_with_doc_to_text_shapes_what_the_tasks_show(invoke, tmp_path):
    """The qa template's text reaches the model: the fake LM records its contexts."""
    import duckdb

    db = tmp_path / "x.duckdb"
    res = invoke("run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--limit", "2", "--template", "qa",
                 "--db", db)
    assert res.exit_code == 0, res.output
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT prompt FROM samples ORDER BY task, doc_id").fetchall()
        template = con.execute("SELECT template, template_text FROM runs").fetchone()
    assert rows and all(p.startswith("Question: ") and p.endswith("\nAnswer:") for (p,) in rows), rows
    assert template[0] == "qa" and "doc_to_text" in template[1]


@pytest.fixture(scope="module")
def gemma_tokenizers():
    reason = gemma.missing()
    if reason:
        pytest.skip(reason)
    from transformers import AutoTokenizer

    from evalkit.engines.llamacpp.firststep import LlamaCppEngine
    from evalkit.engines.llamacpp.tokenizer import tokenizer_of

    path = gemma.gemma_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        eng = LlamaCppEngine(str(path), n_ctx=512)
    except (ImportError, OSError) as exc:  # no llama.cpp engine installed
        pytest.skip(f"llama.cpp engine not available: {exc}")
    return hf, tokenizer_of(eng)


def test_gemma_is_fed_its_bos_on_both_engines_and_both_feed_the_same_ids(gemma_tokenizers):
    hf, gguf = gemma_tokenizers
    for tok in (hf, gguf):
        assert encoding.declared_prefix(tok) == (2,), "Gemma's tokenizer declares <bos> (id 2)"
    qa = get_template("qa")
    for prompt in ("What is the capital of France?", "Translate \"cat\" into French.", "中国的首都是哪里？"):
        for template in (get_template("plain"), qa):
            text = render_prompt(hf, template, prompt)
            a, b = encoding.encode(hf, text), encoding.encode(gguf, text)
            assert a[0] == 2 and a.count(2) == 1
            assert a == b, (prompt, template.name)
        assert encoding.encode(hf, "<bos>" + prompt) == encoding.encode(hf, prompt), "spelled BOS: not twice"


def test_the_default_model_declares_no_bos_so_its_numbers_do_not_move(default_model_available):
    """SmolLM2's GGUF declares no BOS: the ids fed are the text's own on both engines, as before the door."""
    from transformers import AutoTokenizer

    from evalkit.engines.llamacpp.firststep import LlamaCppEngine
    from evalkit.engines.llamacpp.tokenizer import tokenizer_of
    from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir

    folder = default_model_dir()
    assert not gguf_add_bos(folder / DEFAULT_GGUF)
    hf = AutoTokenizer.from_pretrained(str(folder), gguf_file=DEFAULT_GGUF)
    text = render_prompt(hf, get_template("chat"), "What is the capital of France?")
    assert encoding.set_feed(hf, None, gguf_add_bos=gguf_add_bos(folder / DEFAULT_GGUF)).prefix == ()
    assert encoding.encode(hf, text) == hf(text, add_special_tokens=False)["input_ids"]
    try:
        gguf = tokenizer_of(LlamaCppEngine(str(folder / DEFAULT_GGUF), n_ctx=512))
    except (ImportError, OSError) as exc:
        pytest.skip(f"llama.cpp engine not available: {exc}")
    assert encoding.declared_prefix(gguf) == ()
    assert encoding.encode(gguf, text) == gguf(text)["input_ids"]
