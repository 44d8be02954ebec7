"""evalkit on real tokenizers: one row per vocabulary of the llama.cpp sources (tests/zoo.py's zoo).

Usage: python bench/zoo.py [--families llama-spm,qwen2,...] [--all-vocabularies]

Per vocabulary GGUF (`scripts/test-deps.sh` extracts them):
- vocab: the tokenizer's size as transformers builds it;
- transformers / llama.cpp: does the tokenizer load, and how many of llama.cpp's own tokenizer test
  vectors (the .inp texts beside the GGUF and their .out token ids) it reproduces;
and, for the zoo's families (a tiny peaked random-weight model of that vocabulary, tests/zoo.py),
on the 24 prompts of tests/test_zoo.py (12 English, 12 Chinese):
- chat / plain: every first-token metric present and finite in the run under the chat template
  (- where the tokenizer has none) and under `--template plain`;
- exact vs brute: the largest relative difference of ft_hit_prob, answer_prob and opener_mass from a
  brute-force teacher-forced computation (tests/test_zoo.py's), over every third prompt (4 English,
  4 Chinese) of the base's plain and chat runs;
- CPU s/prompt: the `evalkit run` (in-process, imports already paid) CPU seconds per prompt, plain
  template; CPU time, not wall time, as the machine's cores are shared.
`--all-vocabularies` adds the tokenizer columns for every vocabulary GGUF, not only the zoo's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import zoo  # noqa: E402
from tests import test_zoo as checks  # noqa: E402

MARKER = "\n__ggml_vocab_test__\n"


def vectors(family: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test vectors for `family`: (text, token ids), none when absent."""
    inp = zoo.vocab_dir() / (zoo.gguf_name(family) + ".inp")
    out = zoo.vocab_dir() / (zoo.gguf_name(family) + ".out")
    if not inp.is_file() or not out.is_file():
        return []
    texts = inp.read_text(encoding="utf-8").split(MARKER)
    ids = [[int(t) for t in line.split()] for line in out.read_text(encoding="utf-8").splitlines()]
    return list(zip(texts, ids))


def hf_tokenizer(family: str) -> tuple[str, int | None]:
    try:
        tok = zoo.load_tokenizer(family)
    except Exception as exc:  # the table says what transformers could not read
        return f"no ({type(exc).__name__})", None
    vec = vectors(family)
    same = sum(tok(t, add_special_tokens=False)["input_ids"] == ids for t, ids in vec)
    return (f"yes {same}/{len(vec)}" if vec else "yes"), len(tok)


def cpp_tokenizer(family: str) -> str:
    try:
        from evalkit.engines.llamacpp.firststep import LlamaCppEngine
    except ImportError:
        return "n/a"
    try:
        eng = LlamaCppEngine(str(zoo.vocab_dir() / zoo.gguf_name(family)), vocab_only=True)
    except Exception as exc:
        return f"no ({type(exc).__name__})"
    try:
        vec = vectors(family)
        same = sum(eng.tokenize(t, special=False) == ids for t, ids in vec)
    finally:
        eng.close()
    return f"yes {same}/{len(vec)}" if vec else "yes"


def run(folder: Path, template: str, db: Path, prompts: Path) -> tuple[str | None, float]:
    """(run id or None when it failed, CPU seconds) of one in-process `evalkit run`."""
    from click.testing import CliRunner

    from evalkit.cli import cli

    cpu = time.process_time()
    res = CliRunner().invoke(cli, ["run", "--model", "hf", "--model-args", f"pretrained={folder},tolerance=0",
                                   "--prompts", str(prompts), "--template", template, "--device", "cpu",
                                   "--name", f"{folder.name}-{template}", "--db", str(db)])
    cpu = time.process_time() - cpu
    m = re.search(r"^run (\S+)\s+done", res.stdout or "", re.MULTILINE)
    return (m.group(1) if res.exit_code == 0 and m else None), cpu


def metrics_ok(db: Path, run_id: str | None) -> str:
    if run_id is None:
        return "fails"
    wanted = [m for m in checks.first_token_metrics() if m != "top3_share"]
    values = dict(checks.query(db, "SELECT metric, value FROM metrics WHERE run_id = ?", [run_id]))
    bad = [m for m in wanted if values.get(m) is None or not math.isfinite(values[m])]
    return "yes" if not bad else f"missing {','.join(bad)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(zoo.FAMILIES))
    ap.add_argument("--all-vocabularies", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    families = args.families.split(",")
    reason = next((r for f in families if (r := zoo.missing(f))), None)
    if reason:
        print(f"bench/zoo.py: {reason}", file=sys.stderr)
        return 2
    others = []
    if args.all_vocabularies:
        others = sorted(p.name[len("ggml-vocab-"):-len(".gguf")] for p in zoo.vocab_dir().glob("ggml-vocab-*.gguf"))
        others = [f for f in others if f not in families]

    work = Path(tempfile.mkdtemp(prefix="evalkit-zoo-bench-"))
    os.environ.setdefault("EVALKIT_CACHE", str(work / "cache"))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in checks.docs()), encoding="utf-8")
    db = work / "zoo.duckdb"
    n = len(checks.docs())
    print(f"| family | vocab | transformers | llama.cpp | chat | plain | exact vs brute (max rel) | CPU s/prompt |")
    print("|---|---:|---|---|---|---|---:|---:|")
    for family in families + others:
        hf, size = hf_tokenizer(family)
        cpp = cpp_tokenizer(family)
        chat = plain = diff = speed = "-"
        if family in families and size is not None:
            pair = zoo.build_pair(family, work / "models")
            plain_id, cpu = run(pair.base, "plain", db, prompts)
            plain, speed = metrics_ok(db, plain_id), f"{cpu / n:.3f}"
            runs = [plain_id] if plain_id else []
            if pair.chat:
                chat_id, _ = run(pair.base, "chat", db, prompts)
                chat = metrics_ok(db, chat_id)
                runs += [chat_id] if chat_id else []
            if runs:
                worst = checks.exact_differences(pair, db, runs, every=3)
                diff = f"{max(worst.values()):.1e}"
        print(f"| {family} | {size if size is not None else '-'} | {hf} | {cpp} | {chat} | {plain} | {diff} | {speed} |",
              flush=True)
    print(f"\n{n} prompts ({sum(d['lang'] == 'zh' for d in checks.docs())} Chinese); tokenizer columns: loads, "
          "and llama.cpp's test vectors reproduced; transformers " + __import__("transformers").__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
