"""Model backends: the lm-eval model types evalkit runs, and the first-step engine behind them.

Owns: `engine` (one prefill and everything read off the first step), the lm-eval
model types `evalkit-hf` (`hf`) and `evalkit-vllm` (`vllm`), model resolution
(`models`), weight quantization (`quant`) and the names lm-eval registers
(`catalog`). Does not: score text or store anything.
"""
