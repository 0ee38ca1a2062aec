"""Stage 1, the model: what each decoder layer keeps per request, engine-free.

``spec`` (:class:`~kvgeom.model.spec.ModelSpec` and the layer kinds), ``hfconfig`` (a Hugging Face
``config.json`` read into a spec), ``models`` (names, presets and TP sizes), ``presets`` (the shipped
cards), ``csa`` (a hand-built CSA-linear model), ``stages`` (which layers a pipeline stage holds).
Imports nothing of the later stages.
"""
