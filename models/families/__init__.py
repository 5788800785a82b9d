"""One adapter module per Hugging Face model family; models/registry.py maps model_type -> module."""
