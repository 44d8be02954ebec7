"""The llama.cpp engine (`--model llamacpp`, lm-eval type `evalkit-llamacpp`): a GGUF on llama.cpp's own kernels.

`model` (the lm-eval model type), `firststep` (the ctypes engine over one llama.cpp context:
prefill, candidate trees, decoding), `resolve` (its model args, what it refuses, the GGUF's type).
"""
