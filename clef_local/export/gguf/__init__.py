"""``clef-local export-gguf``: a release's text backbone as a GGUF for llama.cpp (issue 48)."""
