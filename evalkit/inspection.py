"""One prompt's first-token distribution, to watch a distribution turn into text (`evalkit inspect`).

Owns: a single look at one prompt with the model a run would load (`engines.resolve` and
`engines.resolve.load`: the embedded SmolLM2 GGUF by default, or `pretrained=...`), putting the
prompt through a template exactly as lm-eval does in a run (the tokenizer's chat template with the template's system message, add_generation_prompt
on; or the raw text, system message glued in front, when the template is not chat), and
reading the first step off `firststep.probe`: the top-k tokens with their probabilities
and cumulative mass, the entropy, top3_mass@T and the greedy first unit and response;
with `attention`, also where the last prompt position looks (docs/metrics.md §1.8): the
prompt tokens it attends to most, mean over heads and over the last layers, the prompt's
sink_rate and the mass on the question inside the template.

Does not: print (see `cli/inspect.py`), store anything, or compute the candidate-based
metrics (ft_hit_prob, opener_mass need a task's accepted answers: use `evalkit run`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from evalkit.defaults import (
    DEFAULT_ATTENTION_LAYERS,
    DEFAULT_INSPECT_TASK,
    DEFAULT_INSPECT_TOP_K,
    DEFAULT_MODEL,
    DEFAULT_TEMPERATURE,
    DEFAULT_TEMPLATE,
)
from evalkit.engines.vocab import bytes_to_unicode
from evalkit.errors import BadInput
from evalkit.prompts.templates import render_prompt

DEFAULT_TASK = DEFAULT_INSPECT_TASK  # the task whose generation settings inspect imitates


@dataclass(frozen=True)
class TokenProb:
    rank: int  # 0 = most likely
    token_id: int
    token: str  # readable label: repr of the text, or the raw bytes of a partial UTF-8 token
    prob: float
    cum: float  # mass of ranks 0..rank
    unit: str = ""  # the first unit the token starts (a split character completed greedily)


@dataclass(frozen=True)
class AttendedToken:
    rank: int  # 0 = attended to most
    position: int  # in the templated prompt, 0 = its first token
    token_id: int
    token: str  # labelled like TokenProb.token
    weight: float  # attention of the last prompt position, mean over heads and the chosen layers


@dataclass
class Inspection:
    prompt: str
    template: str
    model: str
    quant: str | None
    context: str  # the exact text the model saw
    n_context_tokens: int
    temperature: float
    tokens: list[TokenProb] = field(default_factory=list)
    entropy: float = 0.0  # full vocabulary, nats
    top3_mass: float = 0.0  # top-3 mass at `temperature`
    top3_mass_t1: float = 0.0  # top-3 mass at T = 1
    first_token: str = ""  # greedy first token, labelled like `tokens`
    first_unit: str = ""
    response: str = ""
    task: str = ""  # whose generation settings (until, max_gen_toks) the response used
    attention: list[AttendedToken] = field(default_factory=list)  # with --attention: top prompt tokens
    attention_layers: list[int] = field(default_factory=list)  # the layers averaged (0 = the first)
    n_layers: int = 0
    sink_rate: float | None = None  # the prompt's Sink1 (defaults.SINK_TOKENS, SINK_EPSILON)
    question_attn: float | None = None  # mass on the prompt text inside the template (None without one)
    kv_cache: str = "full"  # the KV-cache policy every forward pass ran under


def inspect_prompt(
    prompt: str,
    *,
    template: str = DEFAULT_TEMPLATE,
    quant: str | None = None,
    top_k: int = DEFAULT_INSPECT_TOP_K,
    model_args: str | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
    templates_file: str | None = None,
    task: str = DEFAULT_TASK,
    device: str | None = None,
    attention: bool = False,
    attention_layers: int = DEFAULT_ATTENTION_LAYERS,
    kv_cache: str | None = None,
) -> Inspection:
    """Validate everything, load the model as a run does, and inspect `prompt`'s first step.

    The model is resolved and loaded by `engines.resolve` / `engines.resolve.load`, the path of
    `evalkit run`, and the response is generated with the generation settings of
    `task` (its `until` and `max_gen_toks`), so the first step is a run's first step.
    Raises BadInput for an empty prompt, an unknown template, task or quant, bad model
    args, `top_k < 1`, a temperature that is not a finite number > 0, a `--kv-cache`
    that is not one known policy (or whose backend package is missing) or
    `attention_layers < 1`, before any model is loaded, and for more attention layers
    than the model has right after. The prompt's first step and response are computed
    under the KV-cache policy.
    """
    from evalkit.engines import resolve as models
    from evalkit.prompts.catalog import generation_kwargs
    from evalkit.prompts.templates import get_template
    from evalkit.runner.config import check_device

    if not prompt or not prompt.strip():
        raise BadInput("empty prompt: give the text to inspect, e.g. evalkit inspect \"What is recursion?\"")
    if isinstance(top_k, bool) or not 1 <= top_k <= 10_000:
        raise BadInput(f"--top-k must be a whole number from 1 to 10000, got {top_k}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise BadInput(f"--temperature must be a finite number > 0, got {temperature}")
    if isinstance(attention_layers, bool) or not 1 <= attention_layers <= 10_000:
        raise BadInput(f"--attention-layers must be a whole number from 1 to 10000, got {attention_layers}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadInput(f"the prompt holds text that does not encode as UTF-8 (position {exc.start})") from None
    tmpl = get_template(template, templates_file)
    gen = generation_kwargs(task)
    if kv_cache and "," in kv_cache:
        raise BadInput(f"--kv-cache {kv_cache!r}: inspect takes one policy (a comma list is for evalkit run)")
    plan = models.resolve(DEFAULT_MODEL, model_args, quant_name=quant, device=device, kv_cache=kv_cache,
                          attention=attention)
    check_device(plan.device)
    lm = models.load(plan, batch_size=1)
    if attention:
        n_layers = int(getattr(lm.model.config, "num_hidden_layers", 0) or 0)
        if n_layers and attention_layers > n_layers:
            raise BadInput(f"--attention-layers {attention_layers}: the model has {n_layers} layers")
    context = render_prompt(lm.tokenizer, tmpl, prompt)
    until = gen.get("until") or []
    result = first_step_view(lm.model, lm.tokenizer, context, top_k=min(top_k, len(lm.tokenizer)),
                             temperature=temperature, max_new_tokens=int(gen.get("max_gen_toks", 16)),
                             stop=[until] if isinstance(until, str) else list(until), kv_policy=lm.kv_policy,
                             attention_layers=attention_layers if attention else 0, question=prompt)
    result.prompt, result.template, result.model, result.quant = prompt, tmpl.name, plan.label, plan.quant
    result.task, result.kv_cache = task, lm.kv_policy.spec
    return result


def first_step_view(model, tokenizer, context: str, *, top_k: int = DEFAULT_INSPECT_TOP_K,
                    temperature: float = DEFAULT_TEMPERATURE,
                    max_new_tokens: int = 16, stop: list[str] | tuple[str, ...] = ("\n\n",),
                    kv_policy=None, attention_layers: int = 0, question: str | None = None) -> Inspection:
    """Probe `context` once and lay its first step out for reading (prompt/model fields empty).

    With `attention_layers` > 0 (the model runs `attention.IMPLEMENTATION`), also the `top_k`
    prompt tokens the last position attends to most, mean over heads and the last
    `attention_layers` layers, the prompt's sink_rate, and the mass on `question` when the
    context holds it once inside a template."""
    from evalkit.engines.transformers import attention
    from evalkit.engines.transformers import firststep as engine

    request = None
    if attention_layers > 0:
        spans = {}
        if question and context.count(question) == 1 and context.strip() != question.strip():
            start = context.index(question)
            span = attention.token_span(tokenizer, context, start, start + len(question))
            if span is not None:
                spans["question_attn"] = span
        request = [attention.Request(spans, keep_last_row=True)]
    step = engine.probe(model, tokenizer, [context], top_k=top_k, max_new_tokens=max_new_tokens,
                           stop=stop, batch_size=1, kv_policy=kv_policy, unit_ranks=top_k, attention=request)[0]
    tokens, cum = [], 0.0
    for rank, (tid, lp) in enumerate(zip(step.topk_ids, step.topk_logprobs)):
        prob = math.exp(lp)
        cum += prob
        tokens.append(TokenProb(rank, int(tid), token_label(tokenizer, int(tid)), prob, cum,
                                step.units.get(int(tid), "")))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    response = decode(step.response_ids)
    for text in stop:
        if text:
            response = response.split(text, 1)[0]
    unit, _ = engine.first_unit_ids(decode, step.response_ids)
    return Inspection(
        prompt="", template="", model="", quant=None, context=context,
        n_context_tokens=len(step.context_ids), temperature=temperature, tokens=tokens,
        entropy=step.entropy,
        top3_mass=engine.top_mass(step.logprobs, 3, temperature),
        top3_mass_t1=engine.top_mass(step.logprobs, 3, 1.0),
        first_token=token_label(tokenizer, step.first_token_id),
        first_unit=unit, response=response,
        **(_attended(tokenizer, step, top_k, attention_layers) if step.attention is not None else {}),
    )


def _attended(tokenizer, step, top_k: int, layers: int) -> dict:
    """Inspection fields of the prefill's attention: the top prompt tokens of the last layers' mean row."""
    read = step.attention
    chosen = list(range(read.n_layers))[-layers:]
    n = read.n_tokens
    row = [sum(read.last_row[layer][p] for layer in chosen) / len(chosen) for p in range(n)]
    order = sorted(range(n), key=lambda p: (-row[p], p))[:top_k]
    tokens = [AttendedToken(rank, p, int(step.context_ids[p]), token_label(tokenizer, int(step.context_ids[p])),
                            row[p]) for rank, p in enumerate(order)]
    return {"attention": tokens, "attention_layers": chosen, "n_layers": read.n_layers,
            "sink_rate": read.sink_rate(),
            "question_attn": read.span("question_attn") if "question_attn" in read.spans else None}


def token_label(tokenizer, token_id: int) -> str:
    """A token as a reader can see it: repr of its text, or `<e9 80>` for a piece of a
    UTF-8 character (byte-level BPE spends two or three tokens on one Chinese character).

    >>> class Tok:  # a byte-level vocabulary: 'Ġ' is the space byte, 'é' is 0xe9
    ...     def decode(self, ids): return {1: " the", 2: "\\ufffd"}[ids[0]]
    ...     def convert_ids_to_tokens(self, i): return {1: "Ġthe", 2: "é"}[i]
    >>> token_label(Tok(), 1), token_label(Tok(), 2)
    ("' the'", '<e9>')
    """
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return repr(text)
    raw = _byte_level_bytes(tokenizer.convert_ids_to_tokens(token_id))
    if raw is None:
        return repr(text)
    return "<" + " ".join(f"{b:02x}" for b in raw) + ">"


def _byte_level_bytes(piece: str | None) -> bytes | None:
    """The raw bytes of a GPT-2 byte-level token string, or of a `<0xE9>` byte-fallback token."""
    if not piece:
        return None
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    try:
        return bytes(decoder[c] for c in piece)
    except KeyError:
        return None
