"""The closed sets of values evalkit's modules pass between them, as `Literal` types.

Owns: each kind's name and its members, so a type checker (and a reader) sees every place
that takes one. Does not: hold defaults or behaviour; `typing.get_args(KIND)` lists the
members where code needs them at run time.
"""

from __future__ import annotations

from typing import Literal, get_args

# one checked (rule, task) pair of the release gate
CheckStatus = Literal["pass", "fail", "inconclusive"]
RowStatus = Literal["pass", "fail", "inconclusive", "skipped"]
# the gate as a whole: fail if any row fails, else inconclusive if any row is, else pass
GateOutcome = Literal["pass", "fail", "inconclusive"]
RuleKind = Literal["threshold", "regression"]
# a regression's tolerated drop: an absolute amount, or a share of the baseline's value
MarginKind = Literal["delta", "relative"]
ThresholdOp = Literal[">=", ">", "<=", "<", "=="]
# what exit 3 (inconclusive) becomes under `evalkit gate --on-inconclusive`
OnInconclusive = Literal["pass", "fail"]
# the shipped gate rule sets (docs/gate.md): "same" = the same model, cheaper (equivalence of the
# first-token distribution included); "upgrade" = no worse (non-inferiority on quality only)
RuleSet = Literal["same", "upgrade"]

# --- the metric registry (`scoring.registry.Metric`) ---
# where a metric's value is read: the response text, the first-step distribution, N samples,
# a needle or conflict document, the prefill's attention, a whole run, or two runs side by side
MetricLevel = Literal["text", "distribution", "sampled", "needle", "attention", "conflict", "derived", "pair"]
# share (of prompts, 0..1) | probability | nats | bits | difference | auroc | ratio (of two means)
MetricUnit = Literal["share", "probability", "nats", "bits", "difference", "auroc", "ratio"]
# how per-prompt values become the reported number
Aggregation = Literal["mean", "difference of means", "mean over pairs", "mean over shared prompts", "auroc",
                      "ratio of means"]

# what an engine computes for one prompt, in order (`evalkit run --metrics`, `scoring.selection`): the
# prefill's first-step distribution; the candidate trie over the accepted answer starts, over the checkable
# answers (answers_full), over the opener lexicon; the first unit of each likely first token; the greedy
# response (the task's max_gen_toks); its longer continuation to answer_max_tokens (answer_hit)
EnginePhase = Literal["first_step", "start_trie", "answer_trie", "opener_trie", "units", "response", "answer"]
# the named metric sets of `evalkit run --metrics`: what the gate's default rules read | every metric
MetricSet = Literal["gate", "all"]

# --- the backends ---
# `--kv-cache`: all keys | the newest W | S sinks + the newest W | fp8-rounded | group-quantized |
# llama.cpp's own cache type (llamacpp only)
KVPolicyKind = Literal["full", "window", "sinkwindow", "fp8", "quantized", "ggml"]
# what computes a run's numbers (runs.engine): transformers in this process, llama.cpp's kernels in
# this process, an OpenAI-compatible server's logprobs, vLLM in this process
Engine = Literal["transformers", "llama.cpp", "openai-server", "vllm"]
# what a run's tokenizer identity was hashed from (runs.tokenizer_source): a transformers fast
# tokenizer's tokenizer.json, a slow (Python) transformers tokenizer, a GGUF's vocabulary read by llama.cpp
TokenizerKind = Literal["tokenizer.json", "slow tokenizer", "GGUF vocabulary"]
# how two runs' first-token distributions are compared (docs/metrics.md §1.5): by token id (one
# tokenizer); across two, by the first character of the response from the whole distribution each run
# stored (first_char_topk, `engines.firstchar`), or, for a run stored before it, by the first
# non-whitespace character each stored top-k token adds
EventSpace = Literal["token_id", "first_char_full", "first_char"]
KVQuantBackend = Literal["quanto", "hqq"]  # the library of a quantized:BACKEND:BITS cache
# how a `--quant` variant reaches the weights: cast after loading | quantized while loading |
# quantized after loading | a checkpoint already quantized (backends/quant.py)
QuantMethod = Literal["cast", "load", "after", "checkpoint"]

# --- runs (runs.status) ---
# running: started, its process alive or not yet found gone; done: stored whole; failed: an error
# (runs.error says which); interrupted: SIGINT/SIGTERM, or found abandoned (`rows.abandoned_ids`)
RunStatus = Literal["running", "done", "failed", "interrupted"]
# a run's status as `evalkit runs` / `show` show it: a stored status, or `kept` (a finished run whose
# results wait in a spool file) or `abandoned` (a running run whose process is gone), `store.queries`
ShownStatus = Literal["running", "done", "failed", "interrupted", "kept", "abandoned"]

ROW_STATUSES: tuple[str, ...] = get_args(RowStatus)
MARGIN_KINDS: tuple[str, ...] = get_args(MarginKind)
ON_INCONCLUSIVE: tuple[str, ...] = get_args(OnInconclusive)
RULE_SETS: tuple[str, ...] = get_args(RuleSet)
THRESHOLD_OPS: tuple[str, ...] = get_args(ThresholdOp)
METRIC_LEVELS: tuple[str, ...] = get_args(MetricLevel)
KV_POLICY_KINDS: tuple[str, ...] = get_args(KVPolicyKind)
RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
ENGINE_PHASES: tuple[str, ...] = get_args(EnginePhase)
METRIC_SETS: tuple[str, ...] = get_args(MetricSet)
