"""The llama.cpp first-step engine: one GGUF run by llama.cpp's own kernels, through its low-level API.

Owns, for one GGUF file loaded with llama-cpp-python (`LlamaCppEngine`):
- tokenising and detokenising with the GGUF's own vocabulary (`tokenize`, `piece`, `decode`),
  and the GGUF's chat template rendered as transformers renders one (`GGUFTokenizer`);
- one prefill of a prompt into sequence 0 of a unified KV cache, giving the last position's
  full-vocabulary logits (`prefill`);
- a token tree evaluated as ONE batch over the prompt's cached prefix (`tree`): every
  tree node is one batch token at position P + depth − 1 that belongs to the sequence of
  every leaf below it, and every leaf sequence holds the prompt (`llama_memory_seq_cp` from
  sequence 0 tags the prompt's cells, nothing is copied). llama.cpp lets a token attend to
  the cached cells that share one of its sequences at positions not after its own, so a node
  sees the prompt and its own ancestors and nothing else: the tree's branches are
  alternatives, evaluated side by side. The tree's cells are removed afterwards;
- greedy decoding from the prompt (`generate`) and the KV cache's types (`KV_TYPES`).

Does not: know lm-eval, tasks or metrics (`llamacpp.probe` and `llamacpp.model` turn these numbers into a
`FirstStepResult`), apply sampling beyond what its caller asks, or touch torch.

llama-cpp-python's high-level `Llama` keeps only the last position's logits unless it is
built with `logits_all=True`, and has no way to give one token several sequences; hence the
low-level API (`llama_batch_init`, `llama_decode`, `llama_get_logits_ith`, `llama_memory_*`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evalkit.errors import BadInput
from evalkit.threads import usable_cores

# --kv-cache ggml:TYPE -> llama.cpp's ggml_type of the K and V cache (`full` is f32: nothing rounded)
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
DEFAULT_KV = "f16"  # llama.cpp's own default cache type, as deployed
SEQ_MAX = 256  # llama.cpp's LLAMA_MAX_SEQ: sequences one context can hold (tree leaves per batch)
DEFAULT_N_CTX = 8192  # the context, capped at the model's own training context
N_BATCH = 2048  # tokens one llama_decode call takes (a longer prompt is fed in chunks)


def threads() -> int:
    """CPU threads llama.cpp computes with by default: the cores this process may use."""
    return usable_cores()


_QUIET = None  # the log callback, kept alive for as long as llama.cpp may call it


def _silence(llama_cpp) -> None:
    """Keep llama.cpp's load and decode logs off stderr (what a run needs is in its quant_detail)."""
    global _QUIET
    if _QUIET is None:
        @llama_cpp.llama_log_callback
        def _drop(level, text, user_data):  # noqa: ARG001
            return None

        _QUIET = _drop
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))


MIN_N_CTX = SEQ_MAX  # the smallest context this engine can create (`context_refusal`)


def context_refusal(n_ctx: int, n_batch: int = N_BATCH) -> str | None:
    """Why llama.cpp cannot create this engine's context of `n_ctx` cells, None when it can.

    The engine asks for SEQ_MAX sequences (a trie's leaves share one batch), and llama.cpp reserves
    an output row per sequence in a batch of min(n_ctx, n_batch) tokens: fewer tokens than sequences
    ends the process in GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max), not in an error.

    >>> context_refusal(256), context_refusal(64)[:40]
    (None, 'llama.cpp needs n_ctx >= 256 here (got 6')
    """
    if min(n_ctx, n_batch) < SEQ_MAX:
        return (f"llama.cpp needs n_ctx >= {SEQ_MAX} here (got {n_ctx}): the engine holds up to {SEQ_MAX} "
                f"sequences (a trie's leaves) and llama.cpp keeps an output row for each in a batch of at most "
                f"n_ctx tokens")
    return None


class ContextFull(BadInput):
    """The context has no room for a batch: n_ctx too small for a prompt, its candidate strings and its answer."""


@dataclass(frozen=True)
class ModelFacts:
    """What the loaded GGUF is, for the run row's quant_detail."""

    desc: str  # llama.cpp's one-line description ("llama ?B Q4_1")
    file_type: str  # the GGUF's own quantization type (Q4_1, Q8_0, Q4_K_M ...)
    n_params: int
    size_bytes: int  # all tensors, as stored
    n_ctx_train: int
    n_vocab: int

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.size_bytes / self.n_params if self.n_params else float("nan")


class LlamaCppEngine:
    """One GGUF model and one llama.cpp context with a unified KV cache of `n_ctx` cells."""

    def __init__(self, path: str, *, n_ctx: int | None = None, n_threads: int | None = None,
                 kv_type: str = DEFAULT_KV, n_batch: int = N_BATCH, vocab_only: bool = False,
                 flash_attn: bool = False) -> None:
        """`vocab_only`: the vocabulary and metadata only (tokenising, the chat template), no weights, no
        context. `flash_attn`: llama.cpp's flash attention (see `set_kv_type`)."""
        import llama_cpp

        from evalkit.paths import check_input_path

        check_input_path(path, "GGUF file", "file")  # llama.cpp maps the file: a FIFO would hold it forever
        self.lib = llama_cpp
        _silence(llama_cpp)
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.vocab_only = bool(vocab_only)
        self.model = llama_cpp.llama_model_load_from_file(os.fsencode(path), mparams)
        if not self.model:
            raise ValueError(f"llama.cpp cannot load {path}")
        self.path = path
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(llama_cpp.llama_model_n_ctx_train(self.model))
        self.n_threads = int(n_threads or threads())
        self.n_batch = int(n_batch)  # cut to n_ctx below, as llama.cpp cuts it (a decode never takes more)
        self.flash_attn_asked = bool(flash_attn)
        self.flash_attn = False
        self.ctx = None
        self.kv_type = ""
        self.n_ctx = int(n_ctx or min(self.n_ctx_train or DEFAULT_N_CTX, DEFAULT_N_CTX))
        self.n_batch = min(self.n_batch, self.n_ctx)
        if not vocab_only:
            self.set_kv_type(kv_type)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self.gguf_tokenizer: Any = None  # its `tokenizer.GGUFTokenizer`, made on first use (`tokenizer.tokenizer_of`)
        self.eog = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))

    # -- context ---------------------------------------------------------------

    def set_kv_type(self, kv_type: str) -> None:
        """(Re)create the context with K and V cached as `kv_type` (a KV_TYPES name).

        Flash attention is off unless asked for, as llama-cpp-python, Ollama and LM Studio run by
        default (llama.cpp's own CLI and server default to `auto`, which turns it on for a CPU): on
        the CPU it multiplies Q·K in f16, which moves the default model's first-step log-probs by up
        to 0.12 nats on its top tokens (1.19 on the vocabulary's tail). A quantized V cache needs it,
        so `q8_0` and `q4_0` switch it on (`self.flash_attn` records what ran)."""
        if kv_type not in KV_TYPES:
            raise ValueError(f"unknown llama.cpp KV cache type {kv_type!r} (known: {', '.join(KV_TYPES)})")
        lib = self.lib
        if self.ctx is not None:
            lib.llama_free(self.ctx)
            self.ctx = None
        why = context_refusal(self.n_ctx, self.n_batch)
        if why:  # llama.cpp would abort the process (GGML_ASSERT), not return an error
            raise ValueError(why)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.n_ctx
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(512, self.n_batch)
        cparams.n_seq_max = SEQ_MAX
        cparams.kv_unified = True  # one cache for all sequences: a tree's leaves share the prompt's cells
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.type_k = KV_TYPES[kv_type]
        cparams.type_v = KV_TYPES[kv_type]
        cparams.no_perf = True
        self.flash_attn = self.flash_attn_asked or kv_type in ("q4_0", "q8_0")
        cparams.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                                   else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise ValueError(f"llama.cpp cannot create a context with a {kv_type} KV cache for {self.path}")
        self.mem = lib.llama_get_memory(self.ctx)
        self.kv_type = kv_type
        self.n_ctx = int(lib.llama_n_ctx(self.ctx))

    def close(self) -> None:
        lib = self.lib
        if getattr(self, "ctx", None):
            lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def facts(self) -> ModelFacts:
        lib = self.lib
        buf = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.model, buf, 256)
        return ModelFacts(
            desc=buf.value.decode("utf-8", "replace"),
            file_type=self.meta("general.file_type_name") or _file_type_name(self.meta("general.file_type")),
            n_params=int(lib.llama_model_n_params(self.model)),
            size_bytes=int(lib.llama_model_size(self.model)),
            n_ctx_train=self.n_ctx_train,
            n_vocab=self.n_vocab,
        )

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(65536)
        n = self.lib.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    # -- tokens ------------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        """The GGUF vocabulary's tokens of `text`; `special`: spelled special tokens (<|im_start|>) are parsed."""
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self.lib.llama_token * n_max)()
        n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:
            n_max = -n
            buf = (self.lib.llama_token * n_max)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_bos, special)
        return list(buf[:n])

    def piece(self, token: int, special: bool = True) -> bytes:
        """One token's bytes (`special`: control tokens are rendered, else they are empty)."""
        key = (int(token), special)
        out = self._pieces.get(key)
        if out is None:
            buf = ctypes.create_string_buffer(64)
            n = self.lib.llama_token_to_piece(self.vocab, int(token), buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self.lib.llama_token_to_piece(self.vocab, int(token), buf, -n, 0, special)
            out = self._pieces[key] = buf.raw[:n]
        return out

    def decode(self, ids: Sequence[int], special: bool = True) -> str:
        """Tokens to text; a character split across tokens not all present decodes to U+FFFD."""
        return b"".join(self.piece(t, special) for t in ids).decode("utf-8", "replace")

    # -- forward passes ----------------------------------------------------------------

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]],
                outputs: Sequence[bool]) -> None:
        """One llama_decode of a batch built token by token; raises on failure."""
        lib = self.lib
        n = len(tokens)
        n_seq = max(len(s) for s in seqs)
        batch = lib.llama_batch_init(n, 0, n_seq)
        try:
            for i, (tok, pos, ss, out) in enumerate(zip(tokens, positions, seqs, outputs)):
                batch.token[i] = int(tok)
                batch.pos[i] = int(pos)
                batch.n_seq_id[i] = len(ss)
                for j, s in enumerate(ss):
                    batch.seq_id[i][j] = int(s)
                batch.logits[i] = bool(out)
            batch.n_tokens = n
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            lib.llama_batch_free(batch)
        if rc == 1:  # llama.cpp: no KV slot for the batch
            raise ContextFull(f"llama.cpp's context of {self.n_ctx} cells is full: a prompt, the trie of its "
                              f"candidate strings and its answer need more; raise --model-args n_ctx")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed (code {rc}) on a batch of {n} tokens "
                               f"(context of {self.n_ctx} cells)")

    def logits(self, i: int) -> np.ndarray:
        """The logits after the last decode's i-th batch token (one asked to output; −1: the last
        output), copied: (n_vocab,) float32."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.mem, True)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Clear the cache and feed one prompt into sequence 0; the logits after its last token."""
        return self.prefill_batch([ids])[0]

    def prefill_batch(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Clear the cache and feed prompt i into sequence i (packed into llama_decode calls of at most
        n_batch tokens); the logits after each prompt's last token."""
        if not prompts or len(prompts) >= SEQ_MAX:
            raise ValueError(f"prefill_batch takes 1 to {SEQ_MAX - 1} prompts, got {len(prompts)}")
        if any(not ids for ids in prompts):
            raise ValueError("an empty prompt has nothing to predict from")
        if sum(len(ids) for ids in prompts) >= self.n_ctx:
            raise ValueError(f"prompts of {sum(len(ids) for ids in prompts)} tokens do not fit the context "
                             f"of {self.n_ctx}")
        self.clear()
        flat = [(seq, pos, int(tok)) for seq, ids in enumerate(prompts) for pos, tok in enumerate(ids)]
        out: list[np.ndarray | None] = [None] * len(prompts)
        for begin in range(0, len(flat), self.n_batch):
            chunk = flat[begin : begin + self.n_batch]
            last = [pos == len(prompts[seq]) - 1 for seq, pos, _ in chunk]
            self._decode([t for _, _, t in chunk], [p for _, p, _ in chunk], [(seq,) for seq, _, _ in chunk], last)
            for j, (seq, _, _) in enumerate(chunk):
                if last[j]:
                    out[seq] = self.logits(j)
        return out  # type: ignore[return-value]

    def tree(self, n_prompt: int, nodes: Sequence[tuple[int, ...]], seq: int = 0,
             n_base: int = 1, want: Collection[tuple[int, ...]] | None = None) -> dict[tuple[int, ...], np.ndarray]:
        """Logits after each node of a token tree over the prompt of `n_prompt` tokens in sequence `seq`.

        `nodes` are token paths after the prompt; every proper prefix of a node must be a node
        too (each is fed once). Returns {node: logits after its last token} for the nodes in `want`
        (every node when None): the others are fed for their keys and values only, without the
        vocabulary head (on a 262k vocabulary the head costs about what the rest of a 270M model does).
        The tree's leaves take the sequences n_base .. SEQ_MAX − 1 (sequences below n_base hold
        prompts), each a copy of `seq`'s cells; one llama_decode per group of leaves (at most that many, and N_BATCH tokens).
        The cache holds only the prompts again afterwards.
        """
        nodes = sorted(set(nodes), key=lambda p: (len(p), p))
        if not nodes:
            return {}
        have = set(nodes)
        for node in nodes:
            if len(node) > 1 and node[:-1] not in have:
                raise ValueError(f"tree node {node} has no parent in the tree")
        if not 0 <= seq < n_base < SEQ_MAX:
            raise ValueError(f"sequence {seq} of {n_base} prompt sequences leaves no room for a tree")
        parents = {n[:-1] for n in nodes}
        leaves = [n for n in nodes if n not in parents]
        out: dict[tuple[int, ...], np.ndarray] = {}
        lib = self.lib
        for group in _leaf_groups(leaves, SEQ_MAX - n_base, self.n_batch):
            seqs = range(n_base, n_base + len(group))
            members: dict[tuple[int, ...], list[int]] = {}
            for leaf, s in zip(group, seqs):
                for d in range(1, len(leaf) + 1):
                    members.setdefault(leaf[:d], []).append(s)
            fed = sorted(members, key=lambda p: (len(p), p))  # by depth: a sequence's positions rise
            for s in seqs:
                lib.llama_memory_seq_cp(self.mem, seq, s, -1, -1)
            try:
                asked = [want is None or n in want for n in fed]
                self._decode([n[-1] for n in fed], [n_prompt + len(n) - 1 for n in fed],
                             [members[n] for n in fed], asked)
                # llama_get_logits_ith takes the batch index and maps it to its output row itself
                for i, node in enumerate(fed):
                    if asked[i]:
                        out[node] = self.logits(i)
            finally:
                for s in seqs:
                    lib.llama_memory_seq_rm(self.mem, s, -1, -1)
        return out

    def levels(self, n_prompt: int, nodes: Sequence[tuple[int, ...]], seq: int = 0, n_base: int = 1) -> TreeLevels:
        """A token tree over the prompt in sequence `seq` fed level by level without feeding a node
        twice (`TreeLevels.feed`); `nodes` is the whole tree, of which any subtree may be left unfed."""
        return TreeLevels(self, n_prompt, nodes, seq, n_base)

    def generate(self, n_prompt: int, first: int, limit: int, stop=None) -> list[int]:
        """`generate_batch` of the one prompt in sequence 0."""
        return self.generate_batch([n_prompt], [first], [limit], [stop])[0]

    def generate_batch(self, n_prompts: Sequence[int], firsts: Sequence[int], limits: Sequence[int],
                       stops: Sequence | None = None) -> list[list[int]]:
        """Greedy continuations of the prompts in sequences 0 .. B − 1 (n_prompts[i] tokens each), all
        stepped together (one llama_decode a step): prompt i starts with token firsts[i] and takes at
        most limits[i] tokens, eos excluded; stops[i](ids) True ends it after the token that made it
        so. The cache holds only the prompts again afterwards."""
        B = len(n_prompts)
        stops = list(stops) if stops is not None else [None] * B
        out: list[list[int]] = [[] for _ in range(B)]
        tokens = [int(t) for t in firsts]
        going = []
        for i in range(B):
            if tokens[i] in self.eog:
                continue
            out[i].append(tokens[i])
            if len(out[i]) < limits[i] and not (stops[i] is not None and stops[i](out[i])) \
                    and n_prompts[i] + 1 < self.n_ctx:
                going.append(i)
        try:
            while going:
                self._decode([out[i][-1] for i in going], [n_prompts[i] + len(out[i]) - 1 for i in going],
                             [(i,) for i in going], [True] * len(going))
                nxt = []
                for j, i in enumerate(going):
                    token = int(np.argmax(self.logits(j)))
                    if token in self.eog:
                        continue
                    out[i].append(token)
                    if len(out[i]) >= limits[i] or (stops[i] is not None and stops[i](out[i])) \
                            or n_prompts[i] + len(out[i]) >= self.n_ctx:
                        continue
                    nxt.append(i)
                going = nxt
        finally:
            for i in range(B):
                self.lib.llama_memory_seq_rm(self.mem, i, n_prompts[i], -1)
        return out

    def sequence_logits(self, ids: Sequence[int], start: int) -> np.ndarray:
        """Logits after each of ids[start-1:], one prefill: (len(ids) − start + 1, n_vocab) — the
        distributions that predict ids[start:] and the token after them (loglikelihood)."""
        if not 1 <= start <= len(ids):
            raise ValueError(f"start must be in [1, {len(ids)}], got {start}")
        if len(ids) >= self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        self.clear()
        rows = []
        for begin in range(0, len(ids), self.n_batch):
            chunk = ids[begin : begin + self.n_batch]
            wanted = [begin + j >= start - 1 for j in range(len(chunk))]
            self._decode(chunk, range(begin, begin + len(chunk)), [(0,)] * len(chunk), wanted)
            rows += [self.logits(j) for j, w in enumerate(wanted) if w]
        return np.stack(rows)


class TreeLevels:
    """One token tree fed level by level over a cached prompt: every leaf of the whole tree has its own
    sequence from the start (a copy of the prompt's), so a node fed later attends to its ancestors fed
    earlier, and a subtree never fed costs nothing. Use as a context manager: the tree's cells go on exit."""

    def __init__(self, eng: LlamaCppEngine, n_prompt: int, nodes: Sequence[tuple[int, ...]], seq: int,
                 n_base: int) -> None:
        parents = {n[:-1] for n in nodes}
        leaves = sorted(n for n in set(nodes) if n not in parents)
        if len(leaves) > SEQ_MAX - n_base:
            raise ValueError(f"{len(leaves)} leaves do not fit {SEQ_MAX - n_base} sequences")
        self.eng, self.n_prompt, self.seq = eng, n_prompt, seq
        self.seqs = list(range(n_base, n_base + len(leaves)))
        self.members: dict[tuple[int, ...], list[int]] = {}
        for leaf, s in zip(leaves, self.seqs):
            for d in range(1, len(leaf) + 1):
                self.members.setdefault(leaf[:d], []).append(s)
        self.fed: set[tuple[int, ...]] = set()

    def __enter__(self) -> TreeLevels:
        for s in self.seqs:
            self.eng.lib.llama_memory_seq_cp(self.eng.mem, self.seq, s, -1, -1)
        return self

    def __exit__(self, *exc) -> None:
        for s in self.seqs:
            self.eng.lib.llama_memory_seq_rm(self.eng.mem, s, -1, -1)

    def feed(self, nodes: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], np.ndarray]:
        """Feed `nodes` (tree nodes whose parents were fed before, or of depth 1) in one batch, in
        depth order; {node: logits after it}."""
        batch = sorted(set(nodes), key=lambda p: (len(p), p))
        for node in batch:
            if node not in self.members or node in self.fed or (len(node) > 1 and node[:-1] not in self.fed
                                                                 and node[:-1] not in batch):
                raise ValueError(f"tree node {node} is not in the tree, fed already, or has no fed parent")
        out: dict[tuple[int, ...], np.ndarray] = {}
        for begin in range(0, len(batch), self.eng.n_batch):
            chunk = batch[begin : begin + self.eng.n_batch]
            self.eng._decode([n[-1] for n in chunk], [self.n_prompt + len(n) - 1 for n in chunk],
                             [self.members[n] for n in chunk], [True] * len(chunk))
            for i, node in enumerate(chunk):
                out[node] = self.eng.logits(i)
            self.fed.update(chunk)
        return out


def _leaf_groups(leaves: list[tuple[int, ...]], max_seqs: int, max_tokens: int) -> list[list[tuple[int, ...]]]:
    """Leaves cut into groups of at most `max_seqs`, each group's distinct nodes at most
    `max_tokens` (a node shared by two groups is fed in both); leaves in tree order, so a group
    holds neighbouring branches and shares most of its prefixes.

    >>> _leaf_groups([(1, 2), (1, 3), (4,)], 2, 100)
    [[(1, 2), (1, 3)], [(4,)]]
    """
    groups: list[list[tuple[int, ...]]] = []
    nodes: set[tuple[int, ...]] = set()
    for leaf in sorted(leaves):
        mine = {leaf[:d] for d in range(1, len(leaf) + 1)}
        if groups and len(groups[-1]) < max_seqs and len(nodes | mine) <= max_tokens:
            groups[-1].append(leaf)
            nodes |= mine
        else:
            groups.append([leaf])
            nodes = set(mine)
    return groups


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one row of logits.

    >>> np.round(np.exp(log_softmax(np.array([0.0, np.log(3.0)]))), 6).tolist()
    [0.25, 0.75]
    """
    x = logits.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _file_type_name(value: str | None) -> str:
    """GGUF `general.file_type` number -> llama.cpp's type name (Q4_1, Q4_K_M ...), via the gguf package.

    >>> _file_type_name("3"), _file_type_name("15"), _file_type_name(None)
    ('Q4_1', 'Q4_K_M', 'unknown')
    """
    if value is None or not (str(value).strip().isascii() and str(value).strip().isdigit()):
        return "unknown"
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(value)).name
    except ValueError:
        return f"file_type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
