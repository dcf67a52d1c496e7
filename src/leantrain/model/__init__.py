"""Models: a Llama-style dense decoder and its mixture-of-experts variant, plus Hugging Face interop."""

from leantrain.model.transformer import ModelArgs, Transformer, build_model, model_args_from_spec, num_params

__all__ = ["ModelArgs", "Transformer", "build_model", "model_args_from_spec", "num_params"]
