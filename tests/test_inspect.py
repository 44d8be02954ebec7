"""`evalkit inspect` on the tiny random Llama, checked against a plain softmax of its logits."""

from __future__ import annotations

import ast
import json
import math
import re

import pytest
import torch

from evalkit.cli.inspect import bar
from evalkit.inspection import token_label
from evalkit.prompts.templates import get_template
from evalkit.textsafe import term_line
from tests.tiny import load_tiny

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(.+?)\s+(\d\.\d{6})\s+([█▏▎▍▌▋▊▉]*)\s+(\d\.\d{6})$")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_tiny(tiny_model_dir)


def reference_probs(model, tokenizer, context):
    """softmax(model(ids).logits[0, -1]) on the unpadded context, no cache."""
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def rows_of(output):
    return [m.groups() for line in output.splitlines() if (m := ROW.match(line))]


@pytest.mark.parametrize("prompt", ["What is recursion?", "法国的首都是哪里？"])
def test_bars_match_an_independent_softmax(invoke, tiny_model_dir, tiny, prompt):
    model, tokenizer = tiny
    res = invoke("inspect", prompt, "--model-args", f"pretrained={tiny_model_dir}", "--top-k", "10")
    assert res.exit_code == 0, res.output
    context = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
    probs = reference_probs(model, tokenizer, context)
    top = torch.topk(probs, 10)
    rows = rows_of(res.output)
    assert len(rows) == 10
    cum = 0.0
    for rank, (row, tid, p) in enumerate(zip(rows, top.indices.tolist(), top.values.tolist())):
        r, shown_id, token, prob, bars, shown_cum = row
        cum += p
        assert (int(r), int(shown_id)) == (rank, tid)
        assert float(prob) == pytest.approx(p, abs=1e-5)
        assert float(shown_cum) == pytest.approx(cum, abs=1e-5)
        label = token_label(tokenizer, tid)
        assert token.startswith(label)
        unit, alone = token[len(label):].strip(), tokenizer.decode([tid])  # the unit column
        assert "\ufffd" not in unit
        if "\ufffd" not in alone and alone.strip():
            assert unit == term_line(alone.strip())  # a control character is shown, not sent (textsafe)
        assert bars == bar(p)
    assert "█" in res.output
    assert f"context {len(tokenizer(context, add_special_tokens=False)['input_ids'])} tokens" in res.output
    t = 0.8
    scaled = torch.softmax(torch.log(probs) / t, dim=-1)
    top3 = float(torch.topk(scaled, 3).values.sum())
    assert re.search(rf"top3_mass@0.8\s+{top3:.4f}", res.output)
    entropy = float(-(probs * torch.log(probs)).sum())
    assert f"entropy            {entropy:.4f} nats" in res.output
    assert "greedy first unit" in res.output and "greedy response" in res.output


def test_json_output_and_templates(invoke, tiny_model_dir, tiny):
    model, tokenizer = tiny
    prompt = "Say hello."
    res = invoke("inspect", prompt, "--model-args", f"pretrained={tiny_model_dir}", "--template", "direct",
                 "--top-k", "5", "--temperature", "1.5", "--format", "json")
    data = json.loads(res.stdout)
    system = get_template("direct").system
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": prompt}],
        tokenize=False, add_generation_prompt=True)
    assert data["context"] == expected and system in data["context"]
    assert data["template"] == "direct" and data["temperature"] == 1.5
    probs = reference_probs(model, tokenizer, expected)
    assert [t["token_id"] for t in data["tokens"]] == torch.topk(probs, 5).indices.tolist()
    assert [t["prob"] for t in data["tokens"]] == pytest.approx(torch.topk(probs, 5).values.tolist(), abs=1e-5)
    greedy = int(torch.argmax(probs))
    assert data["first_token"] == token_label(tokenizer, greedy)

    res = invoke("inspect", prompt, "--model-args", f"pretrained={tiny_model_dir}", "--template", "plain",
                 "--top-k", "3", "--format", "json")
    data = json.loads(res.stdout)
    assert data["context"] == prompt  # raw text, no chat template
    probs = reference_probs(model, tokenizer, prompt)
    assert [t["prob"] for t in data["tokens"]] == pytest.approx(torch.topk(probs, 3).values.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "Hi", "--template", "nope"], "unknown template 'nope'"),
        (["inspect", "   "], "empty prompt"),
        (["inspect", "Hi", "--quant", "q2"], "unknown --quant 'q2'"),
        (["inspect", "Hi", "--model-args", "pretrained=/x,batch_size=4"], "batch_size= is set with --batch-size"),
        (["inspect", "Hi", "--model-args", "nonsense"], "malformed --model-args"),
        (["inspect", "Hi", "--top-k", "0"], "--top-k must be a whole number from 1"),
        (["inspect", "Hi", "--model-args", "pretrained=/no/such/model"], "model path not found"),
        (["inspect", "Hi", "--task", "nope"], "unknown task 'nope'"),
        (["inspect", "Hi", "--temperature", "inf"], "--temperature must be a finite number"),
    ],
)
def test_bad_input_exits_2(invoke, args, message):
    res = invoke(*args)
    assert res.exit_code == 2
    assert message in res.output


def test_token_labels_show_bytes_of_partial_characters(tiny):
    _, tokenizer = tiny
    ids = tokenizer("递归 Paris", add_special_tokens=False)["input_ids"]
    labels = [token_label(tokenizer, i) for i in ids]
    assert labels[0].startswith("<") and labels[0].endswith(">")  # a lone UTF-8 lead byte
    raw = b"".join(bytes.fromhex(lbl[1:-1]) if lbl.startswith("<") else ast.literal_eval(lbl).encode()
                   for lbl in labels)
    assert raw == "递归 Paris".encode()


def test_first_step_equals_a_runs(invoke, tiny_model_dir, tmp_path):
    """inspect loads the model as a run does and answers with the task's own generation settings:
    the stored response, first unit and top-k of a run's prompt are what inspect shows for it."""
    db = tmp_path / "run.duckdb"
    res = invoke("run", "--model-args", f"pretrained={tiny_model_dir}", "--tasks", "firsttoken_en", "--limit", "1",
                 "--device", "cpu", "--db", str(db))
    assert res.exit_code == 0, res.output
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    prompt, response, unit = con.execute("SELECT s.prompt, response, first_unit FROM samples s").fetchone()
    topk = con.execute("SELECT token_id, logprob FROM first_token_topk ORDER BY rank LIMIT 10").fetchall()
    con.close()
    data = json.loads(invoke("inspect", "What is recursion?", "--model-args", f"pretrained={tiny_model_dir}",
                             "--device", "cpu", "--format", "json").stdout)
    assert data["context"] == prompt and data["task"] == "firsttoken_en"
    assert data["response"] == response and data["first_unit"] == unit
    assert [t["token_id"] for t in data["tokens"]] == [t for t, _ in topk]
    assert [t["prob"] for t in data["tokens"]] == pytest.approx([math.exp(lp) for _, lp in topk], abs=1e-6)


def test_attention_lists_what_the_last_position_looks_at(invoke, tiny_model_dir, tiny):
    """--attention: the top prompt tokens by the last position's attention, mean over heads and the last
    layers, equal a direct computation from transformers' eager output_attentions."""
    from transformers import AutoModelForCausalLM

    _, tokenizer = tiny
    prompt = "The access code is 7391-2046. What is the access code?"
    res = invoke("inspect", prompt, "--model-args", f"pretrained={tiny_model_dir}", "--top-k", "5",
                 "--attention", "--attention-layers", "1", "--format", "json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    context = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        attn = reference(torch.tensor([ids]), output_attentions=True).attentions
    row = attn[-1][0, :, -1, :].mean(0)  # the last layer, mean over heads
    top = torch.topk(row, 5)
    assert out["attention_layers"] == [len(attn) - 1] and out["n_layers"] == len(attn)
    assert [t["position"] for t in out["attention"]] == top.indices.tolist()
    assert [t["weight"] for t in out["attention"]] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert all(t["token_id"] == ids[t["position"]] for t in out["attention"])
    assert 0.0 <= out["sink_rate"] <= 1.0 and 0.0 < out["question_attn"] < 1.0
    # the table: one bar row per token, then the prompt's sink_rate
    text = invoke("inspect", prompt, "--model-args", f"pretrained={tiny_model_dir}", "--top-k", "3",
                  "--attention", "--attention-layers", "2").output
    assert "mean over heads and layers 0–1 (of 2; 0 = first)" in text and "sink_rate" in text
    # without --attention nothing of it is computed
    plain = json.loads(invoke("inspect", prompt, "--model-args", f"pretrained={tiny_model_dir}",
                              "--format", "json").stdout)
    assert plain["attention"] == [] and plain["sink_rate"] is None
