"""The candidate trie: candidate strings and first units scored in shared forwards after the prompts.

Owns `_Trie` (on `prefill._Forwards`): each prompt's candidates tokenised in context (once per template
frame where the tokenizer allows), their token trie fed level by level after the prompts — one forward a
level, each node attending to its prompt and its ancestors only — with the least likely prefixes left out
within `tolerance`; the first unit of each likely first token completed greedily in the same level
forwards. Rows are grouped by how many nodes they need (`node_groups`), each group on its own copy of its
prompts' cache, so none is padded to another language's trie; a level's logits are read LSE_ROWS node
rows at a time (`read_nodes`).

Does not: prefill, choose the first token or decode (`prefill`, `firststep`, `decoder`); the tolerance rule
and candidate ids themselves are every engine's (`evalkit.engines.firststep`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from evalkit.prompts.encoding import raw_ids
from evalkit.engines.firststep import UNIT_TOKENS, candidate_ids, context_tail, first_unit_ids, tolerance_cut
from evalkit.engines.leadspace import lead_paths, lead_vocab, node_text, whitespace_levels
from evalkit.engines.transformers.prefill import _Forwards
from evalkit.engines.transformers.shared import FIRST_STEP_SHARE, PREFILL_SHARE

# the padded node positions one level forward of the candidate trie may hold. Where the model's head is
# applied apart (`head_split`), a level's logits exist LSE_ROWS node rows at a time, and what bounds a
# group is the KV cache its levels append to (rows x (prompt + every level's width) positions): on the
# whole firsttoken suite, with the decoder's rows beside it, 2048 peaked at 2.16 GiB RSS and 1024 at
# 1.88 GiB (2.02 GB, over the 2 GB budget). Where the whole forward runs, a level's logits are
# positions x vocabulary floats (512 x 49152 x 4 bytes = 100 MB on the default model; 1024 took a
# default run of 64 prompts to 1.98 GB RSS). 512 either way. The default of `Prober`: evalkit-hf derives its
# own from the model's shapes (`engines.caps`), 512 on the default model
TRIE_POSITIONS = 512
FORWARD_POSITIONS = 24  # what a forward costs before its first position, in positions (docs/performance.md)
PAD_SHARE = 0.15  # a trie group may pad this share of its positions
LSE_ROWS = 128  # node rows whose logits exist at once (rows x vocabulary floats: 25 MB)


def _rows_of(cache, rows: torch.Tensor):
    """A new cache holding these batch rows of `cache`, which is left as it was: each layer is a
    shallow copy whose tensors `batch_select_indices` replaces (it indexes, never writes in place)."""
    sub = copy.copy(cache)
    sub.layers = [copy.copy(layer) for layer in cache.layers]
    sub.batch_select_indices(rows)
    return sub


def _truncate_cache(cache, length: int) -> None:
    """Keep the first `length` positions of every layer (`crop`'s meaning differs across
    transformers versions, so the layers are sliced directly)."""
    for layer in cache.layers:
        if hasattr(layer, "truncate"):  # a rounded layer (kvcache) keeps its residual count right
            layer.truncate(length)
        elif getattr(layer, "keys", None) is not None:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


class _Trie(_Forwards):
    """The candidate trie and the first units of one batch, read in level forwards after its prompts."""

    trie_positions: int = TRIE_POSITIONS  # padded node positions a level holds; the caps may set fewer or more

    def in_context(self, context: str, context_ids: list[int], candidate: str) -> list[int]:
        """`candidate_ids(context, candidate)`, computed once per template frame where the tokenizer allows.

        A fast tokenizer cuts its input at added tokens (`<|im_start|>` …) before anything else, so a
        candidate's tokens after a context depend only on the text after the context's last added token:
        the tail ("assistant\\n" under a chat template) is the key, the same for every prompt of a frame.
        The first context seen with each tail is also tokenised whole, and the shortcut is dropped for
        good if any candidate's tokens differ (a tokenizer that does not cut there)."""
        cut = self.frame_cut(context)
        if cut is None:
            return candidate_ids(self.tokenizer, context, candidate, context_ids)
        tail = context[cut:]
        key = (tail, candidate)
        ids = self.tail_ids.get(key)
        if ids is None:
            whole = candidate_ids(self.tokenizer, context, candidate, context_ids)
            # a merge across the boundary: the candidate is tokenised alone, whatever the context
            ids = context_tail(raw_ids(self.tokenizer, tail + candidate), raw_ids(self.tokenizer, tail))
            ids = whole if ids is None else ids
            if ids != whole:  # checked once per key, on the first context with this tail
                self.frame_cuts = False  # this tokenizer does not cut at its added tokens: never again
                return whole
            self.tail_ids[key] = ids
        return ids

    def frame_cut(self, context: str) -> int | None:
        """Where the text after the context's last added token starts (the start of that token), or None."""
        if not self.frame_cuts or not self.added_tokens:
            return None
        best = -1
        for tok in self.added_tokens:
            best = max(best, context.rfind(tok))
        return best if best >= 0 else None

    def whitespace_paths(self, contexts, ids_list, cand_lists, exact_sets, logprobs, cache, mask):
        """The whitespace-led paths of each row's candidates (`engines.leadspace`, docs/metrics.md "One event
        for text and probability"): per row ({path: its tokens}, the trie's candidates; {candidate: its
        paths}; the exact candidates' paths; the whitespace levels, `leadspace.Levels`).

        The whitespace levels are fed here, one forward a level for the whole batch after the prompts (each
        node attending to its prompt and its whitespace ancestors, `forward_nodes`), the cache cropped back
        after; their scored nodes are fed again as the first nodes of the candidate trie."""
        B, P = mask.shape
        lv = lead_vocab(self.tokenizer)
        ws = torch.tensor(lv.ws_ids, dtype=torch.long, device=logprobs.device)
        root = logprobs[:, ws].double().cpu().numpy()
        slot: dict[tuple[int, ...], int] = {}
        used = 0
        n_real = mask.sum(-1).tolist()

        def forward(levels):
            nonlocal used
            depth = len(next(n for nodes in levels for n in nodes))
            feed = [[(r, *n) for n in nodes] for r, nodes in enumerate(levels)]
            out, used = self.forward_nodes(feed, depth, slot, used, cache, mask, n_real)
            reads = [(j, q) for j, nodes in enumerate(feed) for q in range(len(nodes))]
            got: list[list[Any]] = [[None] * len(nodes) for nodes in feed]
            cols = ws.to(out.device)
            for begin in range(0, len(reads), LSE_ROWS):
                chunk = reads[begin:begin + LSE_ROWS]
                jj, qq = (torch.tensor([c[i] for c in chunk], device=out.device) for i in (0, 1))
                logits = (self.split[1](out[jj, qq]) if self.split is not None else out[jj, qq]).float()
                rows = (logits[:, cols] - torch.logsumexp(logits, dim=-1, keepdim=True)).double().cpu().numpy()
                for (j, q), row in zip(chunk, rows):
                    got[j][q] = row
            return got

        state = getattr(cache, "evalkit_state", None)
        if state is not None:  # whitespace nodes are alternatives, never a sequence: no residual flush
            state["hold"] = True
        try:
            levels = whitespace_levels(list(root), lv.ws_ids, self.tolerance, forward)
        finally:
            if used:
                _truncate_cache(cache, P)
            if state is not None:
                state["hold"] = False
        path_toks, paths_of, exact = [], [], []
        for r in range(B):
            context, ids = contexts[r], list(ids_list[r])
            cut = self.frame_cut(context)

            def tokens_in(node, s, context=context, ids=ids, cut=cut):
                if not node:
                    return self.in_context(context, ids, s)
                key = (context[cut:], node, s) if cut is not None else None
                got = self.lead_ids.get(key) if key is not None else None
                if got is None:
                    got = candidate_ids(self.tokenizer, context + node_text(node, lv.ws_text), s, ids + list(node))
                    if key is not None:
                        self.lead_ids[key] = got
                return got

            nodes = {n: node_text(n, lv.ws_text) for n in levels[r].nodes}
            paths = lead_paths(cand_lists[r], lv.spaces, nodes, lv.ws_ids, tokens_in)
            paths_of.append(paths)
            path_toks.append({p: list(p) for ps in paths.values() for p in ps})
            exact.append({p for c in (exact_sets[r] if exact_sets else ()) for p in paths.get(c, ())})
        return path_toks, paths_of, exact, levels

    def score_nodes(self, toks_of, unit_tops, cache, mask, logprobs, exact_sets=None, budgets=None):
        """The candidate trie and the first units of the batch, in shared forwards.

        Returns (per row: ({candidate: P(response starts with it)}, unscored mass, trie positions
        forwarded, first-unit positions forwarded beside them), per row: {top token id: its first unit}).

        Candidates: teacher forcing over the token trie of each prompt's candidates (`toks_of[r]`:
        candidate -> its tokens in context), one trie level per forward. A node is a proper prefix
        `(row, t0, ..., t{d-1})`; fed its last token at position n_real + d - 1 after the prompt, it
        attends to its prompt and its ancestors only (a custom 4-D mask), so shared prefixes are fed
        once and the prompt's cache is never recomputed. Before each level, a prompt's least likely
        new prefixes are left out while their total probability fits in what is left of its
        `tolerance` (see `probe`); prefixes of the prompt's exact candidates never are.

        First units: each token of `unit_tops[r]` that holds no whole character alone is completed
        greedily (`first_unit_ids`), at most UNIT_TOKENS tokens deep; its nodes ride in the same
        level forwards, and a node the trie already feeds is not fed twice. "" when no unit is
        whole by then. Tokens that are whole alone map to their own stripped text.

        Rows are grouped by how many nodes their first level holds, and each group runs its levels
        on its own copy of its rows' prompt cache, so a row is padded only to its group's widest
        level, not the batch's: an English prompt's few dozen nodes do not wait on a Chinese one's
        two hundred. The prompt cache is left as it was.
        """
        B, P = mask.shape
        kept: set[tuple[int, ...]] = set()  # prefixes of exact candidates: always forced
        for r in range(B):
            for c in (exact_sets[r] if exact_sets else ()):
                tk = toks_of[r].get(c, [])
                kept.update((r, *tk[:d]) for d in range(1, len(tk)))
        # node -> {next token: log P(next | node)}; the root's is read from the prefill's full row
        child_lp: dict[tuple[int, ...], dict[int, float]] = {}
        trie_done: set[tuple[int, ...]] = {(r,) for r in range(B)}  # the root and every trie node forwarded
        node_sum: dict[tuple[int, ...], float] = {(r,): 0.0 for r in range(B)}  # log P(prefix)
        wanted: dict[tuple[int, ...], set[int]] = {}  # node -> the next tokens the trie reads off it
        for r in range(B):
            for tk in toks_of[r].values():
                for d in range(len(tk)):
                    wanted.setdefault((r, *tk[:d]), set()).add(tk[d])
        for r in range(B):
            child_lp[(r,)] = {t: float(logprobs[r, t]) for t in wanted.get((r,), ())}
        units: list[dict[int, str]] = [{} for _ in range(B)]
        unit_open: list[list[tuple[int, ...]]] = [[] for _ in range(B)]  # nodes whose greedy next token is wanted
        for r, ids in enumerate(unit_tops):
            for t in ids:
                unit, _ = first_unit_ids(self.decode, [t])
                if unit:
                    units[r][t] = unit
                else:
                    unit_open[r].append((r, t))
        start = list(budgets) if budgets is not None else [self.tolerance] * B
        budget = list(start)  # probability each prompt may still leave unscored
        positions = [0] * B
        unit_fed = [0] * B  # first-unit nodes forwarded that the trie did not feed
        depth_max = max(max((len(tk) for d in toks_of for tk in d.values()), default=0) - 1,
                        UNIT_TOKENS - 1 if any(unit_open) else 0)

        def trie_level(r: int, depth: int) -> list[tuple[int, ...]]:
            """Row r's trie nodes of this depth that are forwarded, after the tolerance cut."""
            fresh = []
            for tk in toks_of[r].values():
                if len(tk) <= depth:
                    continue
                node, parent = (r, *tk[:depth]), (r, *tk[: depth - 1])
                if parent not in trie_done or node in node_sum:
                    continue  # parent left out, or node already queued
                node_sum[node] = node_sum[parent] + child_lp[parent][node[-1]]
                fresh.append(node)
            level, budget[r] = tolerance_cut(fresh, node_sum, kept, budget[r])
            positions[r] += len(level)
            trie_done.update(level)
            return level

        state = getattr(cache, "evalkit_state", None)
        if state is not None:  # trie nodes are alternatives, never a sequence: no residual flush
            state["hold"] = True
        try:
            if depth_max >= 1:
                first_level = [trie_level(r, 1) for r in range(B)]
                groups = self.node_groups(first_level, unit_open)
                for g, rows in enumerate(groups):
                    self.progress(f"candidate trie {g + 1}/{len(groups)}",
                                  PREFILL_SHARE + (FIRST_STEP_SHARE - PREFILL_SHARE) * g / len(groups))
                    self.score_group(rows, first_level, unit_open, trie_level, depth_max, cache, mask, child_lp,
                                     wanted, units, unit_fed)
        finally:
            if state is not None:
                state["hold"] = False
        for nodes in unit_open:  # a token whose unit no level completed: ""
            for node in nodes:
                units[node[0]].setdefault(node[1], "")
        out = []
        for r in range(B):
            probs = {}
            for cand, tk in toks_of[r].items():
                if not tk:
                    probs[cand] = 1.0
                    continue
                last = (r, *tk[:-1])
                if last not in trie_done:  # under a prefix left out: counted in the unscored mass
                    probs[cand] = 0.0
                    continue
                probs[cand] = math.exp(node_sum[last] + child_lp[last][tk[-1]])
            out.append((probs, start[r] - budget[r], positions[r], unit_fed[r]))
        return out, units

    def node_groups(self, first_level, unit_open) -> list[list[int]]:
        """Rows cut into groups that share level forwards: rows with like first levels together (their
        deeper levels are alike too). A forward costs about FORWARD_POSITIONS positions before it computes
        any (the weights are read from memory once a forward), so a row joins the group before it while
        the padding that adds stays under that, or under PAD_SHARE of the group's positions; a group
        holds at most `trie_positions` padded positions a level (TRIE_POSITIONS unless the caps say otherwise)."""
        B = len(first_level)
        if self.policy.rounds:  # a rounded cache is never copied: one group
            return [list(range(B))]
        width = [len(first_level[r]) + len(unit_open[r]) for r in range(B)]
        order = sorted((r for r in range(B) if width[r]), key=lambda r: (width[r], r))
        groups: list[list[int]] = []
        for r in order:
            g = groups[-1] if groups else None
            if g is not None:
                padded = (len(g) + 1) * width[r]
                padding = padded - sum(width[i] for i in g) - width[r]
                if padded <= self.trie_positions and padding <= max(FORWARD_POSITIONS, PAD_SHARE * padded):
                    g.append(r)
                    continue
            groups.append([r])
        return groups

    def score_group(self, rows, first_level, unit_open, trie_level, depth_max, cache, mask, child_lp, wanted,
                    units, unit_fed) -> None:
        """Run every level of these rows' trie and unit nodes on a copy of their prompt cache (the
        batch's own cache, cropped back after, when the group is the whole batch)."""
        B, P = mask.shape
        whole = len(rows) == B
        if whole:  # the batch's own cache: its rows in its order
            rows = list(range(B))
        sub = cache if whole else _rows_of(cache, torch.tensor(rows, device=self.device))
        sub_mask = mask if whole else mask[rows]
        slot: dict[tuple[int, ...], int] = {}  # node -> its column after the prompt
        used = 0
        n_real = sub_mask.sum(-1).tolist()
        try:
            level = {r: first_level[r] for r in rows}
            opened = {r: unit_open[r] for r in rows}  # per row: unit nodes whose greedy next token is wanted
            for depth in range(1, depth_max + 1):
                if depth > 1:
                    level = {r: trie_level(r, depth) for r in rows}
                feed: list[list[tuple[int, ...]]] = []
                for r in rows:
                    nodes = list(level[r])
                    seen = set(nodes)
                    extra = [n for n in opened[r] if n not in seen]
                    unit_fed[r] += len(extra)
                    feed.append(nodes + extra)
                if not any(feed):
                    break
                out, used = self.forward_nodes(feed, depth, slot, used, sub, sub_mask, n_real)
                open_now = {n for r in rows for n in opened[r]}
                reads = [(j, q, node) for j, nodes in enumerate(feed) for q, node in enumerate(nodes)]
                units_read, greedy = self.read_nodes(out, reads, wanted, open_now, child_lp)
                nxt: dict[int, list[tuple[int, ...]]] = {r: [] for r in rows}
                for (_, _, node), token in zip(units_read, greedy):
                    child = (*node, int(token))
                    unit, _ = first_unit_ids(self.decode, list(child[1:]))
                    if unit or child[-1] in self.eos:
                        units[node[0]][node[1]] = unit
                    elif depth + 1 < UNIT_TOKENS:
                        nxt[node[0]].append(child)
                    else:
                        units[node[0]][node[1]] = ""
                opened = nxt
        finally:
            if whole and used:
                _truncate_cache(cache, P)

    def read_nodes(self, out, reads, wanted, units_open, child_lp) -> tuple[list[tuple[int, int, Any]], list[int]]:
        """Read one trie level's forward, LSE_ROWS node positions at a time: each read node's log-probability
        of every next token the trie wants off it (into `child_lp`), and the greedy next token of each node
        in `units_open`. `out` is the level's logits, or its last hidden states where the head is applied
        here (`head_split`): only `reads`' positions, never the padding, pay for the head.
        Returns (the reads in `units_open`, their greedy tokens)."""
        split = self.split
        units_read: list[tuple[int, int, Any]] = []
        greedy: list[int] = []
        for begin in range(0, len(reads), LSE_ROWS):
            chunk = reads[begin:begin + LSE_ROWS]
            jj, qq = (torch.tensor([r[i] for r in chunk], device=out.device) for i in (0, 1))
            logits = (split[1](out[jj, qq]) if split is not None else out[jj, qq]).float()  # (n, V)
            lse = torch.logsumexp(logits, dim=-1)
            pairs = [(i, t) for i, (_, _, node) in enumerate(chunk) for t in wanted.get(node, ())]
            if pairs:
                ii, tt = (torch.tensor([p[k] for p in pairs], device=out.device) for k in (0, 1))
                for (i, t), v in zip(pairs, (logits[ii, tt] - lse[ii]).tolist()):
                    child_lp.setdefault(chunk[i][2], {})[t] = v
            opened = [i for i, (_, _, node) in enumerate(chunk) if node in units_open]
            if opened:
                units_read += [chunk[i] for i in opened]
                greedy += torch.argmax(logits[torch.tensor(opened, device=out.device)], dim=-1).tolist()
        return units_read, greedy

    def forward_nodes(self, level, depth: int, slot: dict, used: int, cache, mask, n_real):
        """Forward one level of token trees packed after the prompts: (logits (B, Q, V), or the last hidden
        states (B, Q, H) where the head is applied apart (`head_split`); columns used).

        `level[r]` holds row r's nodes `(row, t0, ..., t{depth-1})`, each fed its last token at
        position n_real + depth - 1 and attending to its prompt and its ancestors (whose
        columns after the prompt `slot` records; the level's own columns are added to it),
        under the KV-cache policy. The nodes are alternatives: the caller crops the cache back
        to the prompt (or drops its copy) when its trees are done."""
        B, P = mask.shape
        Q = max(len(nodes) for nodes in level)
        real = torch.tensor(n_real, dtype=torch.long)
        inp = torch.full((B, Q), self.pad_id, dtype=torch.long)
        pos = (real + depth - 1).unsqueeze(1).expand(B, Q).clone()
        allow = torch.zeros((B, Q, P + used + Q), dtype=torch.bool)
        allow[:, :, :P] = mask.bool().cpu().unsqueeze(1)
        rr, jj, tok, ar, aj, ac, anc_pos = [], [], [], [], [], [], []
        for r, nodes in enumerate(level):
            for j, node in enumerate(nodes):
                rr.append(r)
                jj.append(j)
                tok.append(node[-1])
                for k in range(2, len(node)):  # ancestors (row, t0), (row, t0, t1), ... at position n_real + k - 2
                    ar.append(r)
                    aj.append(j)
                    ac.append(P + slot[node[:k]])
                    anc_pos.append(n_real[r] + k - 2)
                slot[node] = used + j
        if rr:
            r_t, j_t = torch.tensor(rr), torch.tensor(jj)
            inp[r_t, j_t] = torch.tensor(tok, dtype=torch.long)
            allow[r_t, j_t, P + used + j_t] = True
        if ar:
            a_r, a_j, a_c = torch.tensor(ar), torch.tensor(aj), torch.tensor(ac)
            ok = torch.ones(len(ar), dtype=torch.bool)
            if self.policy.evicts:
                ok = self.policy.visible(real[a_r] + depth - 1, torch.tensor(anc_pos))
            allow[a_r[ok], a_j[ok], a_c[ok]] = True
        if self.policy.evicts:  # each node reads the prompt keys the policy keeps at its position
            prompt_pos = ((mask.cumsum(-1) - 1).clamp(min=0)).cpu()
            allow[:, :, :P] &= self.policy.visible(pos[:, :, None], prompt_pos[:, None, :])
        attn = self.additive(allow.to(self.device))  # the float mask is made where the model runs
        key_pos = None
        if self.windows is not None:  # each column's position: a sliding layer reads the last `window` of them
            key_pos = torch.zeros((B, P + used + Q), dtype=torch.long)
            key_pos[:, :P] = ((mask.cumsum(-1) - 1).clamp(min=0)).cpu()
            if ar:
                key_pos[a_r, a_c] = torch.tensor(anc_pos)
            if rr:
                key_pos[r_t, P + used + j_t] = pos[r_t, j_t]
            key_pos = key_pos.to(self.device)
        out, _ = self.forward(inp.to(self.device), attn, pos.to(self.device), cache=cache,
                              hidden_only=self.split is not None, key_pos=key_pos)
        return out, used + Q
