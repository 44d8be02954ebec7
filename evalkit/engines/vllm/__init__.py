"""The vLLM engine (`--model vllm`, lm-eval type `evalkit-vllm`): lm-eval's vLLM model, first step read off its logprobs.

`model` (the lm-eval model type), `resolve` (its model args and the logprobs it is asked for).
"""
