"""The request path, backend-free: schema → encoder (validation, size, media, tokens) → batching → layout → answers.

``clef_local.model.ClefModel`` strings these together around a backend (:mod:`clef_local.backends`) and a head
(:mod:`clef_local.heads`); nothing here imports a backend, the server, the UI or the CLI. docs/architecture.md
walks one request through these files.
"""
