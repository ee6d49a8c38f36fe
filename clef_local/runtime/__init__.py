"""The request path, backend-free: schema → tokenizer → encoding → batching → layout → head → answers.

``clef_local.model.ClefModel`` strings these together around a backend (:mod:`clef_local.backends`); nothing here
imports a backend, the server, the UI or the CLI. docs/architecture.md walks one request through these files.
"""
