"""Text in and out of a model: tokenizers (Hugging Face's tokenizer.json, a GGUF file's
vocabulary), chat templates rendered in jinja2's sandbox, and the errors they raise. No torch."""
