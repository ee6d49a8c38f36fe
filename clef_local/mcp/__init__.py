"""``clef-local mcp``: Clef models as Model Context Protocol tools that agents call (docs/mcp.md), over stdio or
streamable HTTP, with the official ``mcp`` SDK (the ``mcp`` extra).

The modules: :mod:`.tools` (the tools' schemas, generated from the request model, and their arguments as SystemOne
requests), :mod:`.states` (the states ``ask_again`` refers to), :mod:`.server` (the calls: encoding, the serve
scheduler, answers and errors as MCP results), :mod:`.http` (the streamable HTTP app behind serve's guard) and
:mod:`.run` (the command). Importing this package is cheap: the SDK loads only when a server is built.
"""

from __future__ import annotations
