"""Labelled request data: the packaged BANKING77 / NLU++ files, their readers, labelled JSONL, probe requests and
``clef-local data convert``."""
