"""Writing variants of a release: ``quantize`` (round-to-nearest or GPTQ), its staging and validation, and
``export-onnx`` (``onnx/``)."""
