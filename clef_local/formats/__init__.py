"""The Clef release format on disk: a release directory, its head config, manifest and safetensors headers.

docs/format.md describes the format these readers implement.
"""
