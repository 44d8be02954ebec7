"""A tiny random-weight Llama with a real byte-level BPE tokenizer, built offline in about a second.

Owns: `build_tiny_model(path)` (train the tokenizer on a built-in English/Chinese
corpus, build a seeded `LlamaForCausalLM`, `save_pretrained` both so the `Auto*`
classes load them offline) and `load_tiny(path)`.
Does not: download anything, or pretend to be a useful language model; its weights
are random. Its logits are made peaked (large init) so argmax ties do not occur.

The tokenizer behaves like SmolLM2's where evalkit cares: byte-level BPE (a rare
Chinese character costs two or three byte tokens, and the first byte token is shared
by many characters), `<|im_start|>` / `<|im_end|>` (eos) and a ChatML chat template.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]

# SmolLM2-135M-Instruct's template, with a shorter default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "Recursion is when a function calls itself until a base case stops it.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Sure, I'd be happy to help. Certainly, here is the answer.",
    "Of course! Great question. Well, as an AI, I think the answer is simple.",
    "The access code is 7391-2046. Look at the first sentence.",
    "Hello, how are you today? I am fine, thank you very much.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Python is a programming language used for data science and the web.",
    "好的，我来回答这个问题。当然，首先我们需要理解这个概念。",
    "关于这个问题，作为一个人工智能助手，我认为答案很简单。",
    "感谢你的问题。嗯，是的，法国的首都是巴黎。",
    "中国的首都是北京，日本的首都是东京。",
    "请看第一句话。编号是2025-0419。",
    "今天天气很好，我们一起去公园散步吧。",
    "机器学习是人工智能的一个分支，它让计算机从数据中学习。",
]
VOCAB_SIZE = 600


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (vocab ~600) on `CORPUS`; wrap it with ChatML specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(path: Path) -> Path:
    """Build and save the tiny model and tokenizer under `path`; return `path`."""
    path = Path(path)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=4096,
        initializer_range=0.5,  # peaked logits: no near-ties for greedy decoding
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_tiny(path: Path):
    """Load what `build_tiny_model` saved: (model in eval mode, tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
