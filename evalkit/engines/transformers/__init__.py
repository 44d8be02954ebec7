"""The transformers engine (`--model hf`, lm-eval type `evalkit-hf`): a Hugging Face causal LM in this process.

`model` (the lm-eval model type), `firststep` (one prefill and everything read off the first
step), `resolve` (its model args, checked, and those of lm-eval's Hugging Face kind), and what
only an in-process model allows: `quant` (`--quant`), `kvcache` (the rounded caches of
`--kv-cache`), `attention` (`--attention`), `convert` (a GGUF loaded once into a cached folder),
`teacher` (teacher forcing for drift), `offline` (no hub kernel unless asked).
"""
