"""Integrations with other libraries: `huggingface` (load_model for transformers causal LMs)."""
