"""What readers call a run's model: one definition for the run row (`runs.model_name`, written when a
model is resolved) and the report (runs stored without a model_name). It sits on the floor so the
report, which reads stored runs only, does not import the layer that loads models."""

from __future__ import annotations

from typing import Any


def model_label(model_type: str, args: dict[str, Any]) -> str:
    """What a reader calls the model: the pretrained folder or hub id's last part (+ its GGUF file);
    the model type when no model is named (`runs.model_name`, the report's model column).

    >>> model_label("hf", {"pretrained": "/models/Qwen2.5-0.5B/", "gguf_file": "q4.gguf"}), model_label("hf", {})
    ('Qwen2.5-0.5B (q4.gguf)', 'hf')
    """
    pretrained = args.get("pretrained")
    if not isinstance(pretrained, str) or not pretrained:
        return model_type
    name = pretrained.rstrip("/").rsplit("/", 1)[-1]
    return f"{name} ({args['gguf_file']})" if args.get("gguf_file") else name
