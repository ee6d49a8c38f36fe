"""clef_local.export (installed under clef_local, see pyproject's package-dir): writing variants of a release —
``quantize`` (round-to-nearest or GPTQ), its staging and validation, and ``export-onnx`` (``onnx/``)."""
