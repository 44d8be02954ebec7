"""A zoo of tiny random-weight models on real tokenizers, each with its permuted-id twin.

Owns:
- where the vocabularies come from: the vocabulary-only GGUFs of the llama-cpp-python sdist
  (`vendor/llama.cpp/models/ggml-vocab-*.gguf`), which `scripts/test-deps.sh` extracts into
  `vocab_dir()` (EVALKIT_TEST_VOCAB, default ~/.cache/evalkit-test/vocab); `missing()` says why a
  family cannot be had, for the tests to skip with;
- `load_tokenizer(family)`: the family's tokenizer as transformers builds it from the GGUF
  (`PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=...)`: transformers' own GGUF
  tokenizer conversion; `AutoTokenizer` would also parse the GGUF's model config, which costs
  10x the time and which transformers rejects for gemma-4);
- `build_pair(family, root)`: a tiny seeded model of that vocabulary (hidden 64, 2 layers), peaked
  by scaling its final norm's weight (`NORM_SCALE`), saved as a Hugging Face folder that
  `evalkit run --model hf --model-args pretrained=FOLDER` loads, and its twin: every regular
  token id permuted, in the tokenizer (its vocabulary; merges and the pre/post-processing name
  tokens by text, so they hold as they are) and in the embedding and output rows alike. The
  added and special tokens keep their ids. On any text the twin's tokens are the base's under
  the permutation and its next-token distribution is the base's under the same permutation, so
  what it says (its first-token text distribution) is the base's on every prompt;
- `write_gguf(folder, family, path)`: the same weights as a llama-architecture GGUF, with the
  vocabulary GGUF's tokenizer metadata, for the llama.cpp engine.

Does not: download anything (tests/conftest.py skips without the vocabularies), or make a useful
language model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_ENV = "EVALKIT_TEST_VOCAB"
# the families the zoo builds: Llama 2's SentencePiece (32k), Llama 3's BPE (128k), Qwen2's
# byte-level BPE (152k), Phi-3's SentencePiece (32k + chat specials) and Gemma 4's (262k)
FAMILIES = ("llama-spm", "llama-bpe", "qwen2", "phi-3", "gemma-4")
# scaling the final RMSNorm's weight to this makes the first-token distributions peaked (top-5 mass
# about 0.7 on these models) rather than nearly uniform over the vocabulary
NORM_SCALE = 40.0
SEED = 0


def vocab_dir() -> Path:
    return Path(os.environ.get(VOCAB_ENV) or Path.home() / ".cache" / "evalkit-test" / "vocab")


def gguf_name(family: str) -> str:
    return f"ggml-vocab-{family}.gguf"


def missing(family: str) -> str | None:
    """Why `family`'s vocabulary cannot be had (the skip reason), or None when it is there."""
    path = vocab_dir() / gguf_name(family)
    if path.is_file():
        return None
    return f"no {path} (bash scripts/test-deps.sh extracts the tokenizer vocabularies; set {VOCAB_ENV} to another folder)"


def load_tokenizer(family: str):
    """`family`'s tokenizer, built by transformers from its vocabulary GGUF."""
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the GGUF reader's notes on what it leaves out
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(vocab_dir()), gguf_file=gguf_name(family))
    finally:
        logging.set_verbosity(verbosity)


@dataclass
class Pair:
    """One family's base model and its permuted-id twin, as Hugging Face folders."""

    family: str
    base: Path
    twin: Path
    vocab_size: int
    perm: torch.Tensor  # (vocab_size,) long: the twin's id of each base id
    chat: bool  # the tokenizer has a chat template
    tied: bool  # input and output embeddings share one matrix


def fixed_ids(tokenizer) -> set[int]:
    """The ids the twin keeps: added tokens (special or not) and every special token."""
    ids = set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model.get("unk_id") is not None:  # Unigram names its unknown token by id
        ids.add(int(model["unk_id"]))
    return ids


def permutation(tokenizer, vocab_size: int, seed: int = SEED) -> torch.Tensor:
    """A seeded permutation of every id outside `fixed_ids`, identity on those."""
    fixed = fixed_ids(tokenizer)
    regular = torch.tensor([i for i in range(vocab_size) if i not in fixed])
    g = torch.Generator().manual_seed(seed)
    perm = torch.arange(vocab_size)
    perm[regular] = regular[torch.randperm(len(regular), generator=g)]
    return perm


def permuted_tokenizer_json(tokenizer, perm: torch.Tensor) -> str:
    """tokenizer.json of `tokenizer` with each vocabulary id i moved to perm[i]. BPE, WordPiece and
    WordLevel map text to id; Unigram lists its pieces in id order. Merges, normalizers, pre- and
    post-processors and decoders name tokens by text (the fixed special tokens aside)."""
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    model = data["model"]
    p = perm.tolist()
    if isinstance(model.get("vocab"), dict):
        model["vocab"] = {text: p[i] for text, i in model["vocab"].items()}
    elif isinstance(model.get("vocab"), list):  # Unigram: [piece, score] at index id
        pieces: list = [None] * len(model["vocab"])
        for i, piece in enumerate(model["vocab"]):
            pieces[p[i]] = piece
        model["vocab"] = pieces
    else:
        raise ValueError(f"no vocabulary to permute in a {model.get('type')} tokenizer")
    return json.dumps(data, ensure_ascii=False)


def _config(tokenizer, vocab_size: int, family: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    # untied: with tied embeddings the peaked model mostly predicts its input token again (top-5
    # mass 1.0); the twin permutes the input and the output rows alike either way
    if family.startswith("qwen"):  # Qwen2's own architecture (q/k/v biases)
        return Qwen2Config(**common, tie_word_embeddings=False)
    return LlamaConfig(**common, tie_word_embeddings=False)


def _save(model, tokenizer, folder: Path) -> None:
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_pair(family: str, root: Path) -> Pair:
    """Build and save `family`'s base model and permuted twin under `root`; check the twin."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    tokenizer = load_tokenizer(family)
    vocab_size = len(tokenizer)
    torch.manual_seed(SEED)
    config = _config(tokenizer, vocab_size, family)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
    base = Path(root) / family
    _save(model, tokenizer, base)

    perm = permutation(tokenizer, vocab_size)
    twin_tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(permuted_tokenizer_json(tokenizer, perm)),
        **{k: v for k, v in tokenizer.init_kwargs.items() if k not in ("tokenizer_object", "tokenizer_file", "name_or_path", "gguf_file", "vocab_file")},
    )
    tied = bool(config.tie_word_embeddings)
    with torch.no_grad():
        inv = torch.argsort(perm)  # the base id at each twin id
        model.get_input_embeddings().weight.copy_(model.get_input_embeddings().weight[inv])
        if not tied:
            model.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight[inv])
    twin = Path(root) / f"{family}-twin"
    _save(model, twin_tok, twin)

    # the twin as evalkit will load it: every token's text at its new id, the chat template kept
    reloaded = AutoTokenizer.from_pretrained(twin)
    base_tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    twin_tokens = reloaded.convert_ids_to_tokens(perm.tolist())
    if base_tokens != twin_tokens or reloaded.chat_template != tokenizer.chat_template:
        bad = next((i for i, (a, b) in enumerate(zip(base_tokens, twin_tokens)) if a != b), None)
        raise AssertionError(f"{family}: the twin tokenizer does not hold the permuted vocabulary (first at id {bad})")
    return Pair(family, base, twin, vocab_size, perm, bool(tokenizer.chat_template), tied)


# ---- the same weights as a GGUF for llama.cpp ---------------------------------------------------


def _rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """q/k rows from Hugging Face's rotate-half order to llama.cpp's interleaved pairs (what
    llama.cpp's convert_hf_to_gguf.py does for the llama architecture)."""
    out, inp = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, inp).swapaxes(1, 2).reshape(out, inp)


def write_gguf(folder: Path, family: str, path: Path) -> Path:
    """The llama-architecture model saved in `folder` as an F32 GGUF at `path`, with the tokenizer
    metadata (every `tokenizer.*` key) of `family`'s vocabulary GGUF."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = model.config
    if cfg.model_type != "llama":
        raise ValueError(f"write_gguf writes the llama architecture, not {cfg.model_type}")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"evalkit-zoo-{family}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                              else float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    reader = gguf.GGUFReader(str(vocab_dir() / gguf_name(family)))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = torch.from_numpy(sd[p + "self_attn.q_proj.weight"])
        k = torch.from_numpy(sd[p + "self_attn.k_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", _rope_rows(q, cfg.num_attention_heads).numpy())
        writer.add_tensor(f"blk.{i}.attn_k.weight", _rope_rows(k, cfg.num_key_value_heads).numpy())
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

