"""Layer 1, core: what every other layer speaks — errors, content hashes, the trace schema, the recipe and
its validation, named presets with citations, and the registries higher layers fill.

Nothing here imports another layer (``docs/architecture.md``, "Layers").
"""
