"""Stage 2, the rank layout: one engine rank's groups, regions and state layout.

``engine`` (:class:`~kvgeom.layout.engine.EngineConfig`), ``geometry``
(:class:`~kvgeom.layout.geometry.RankGeometry`, its allocation families), ``csarows`` (block-outermost CSA
rows), ``conv`` (conv-state pieces), ``card`` (:class:`~kvgeom.layout.card.GeometryCard`, what a rank
tells its peer), ``view`` (:class:`~kvgeom.layout.view.EngineView`: the transfer streams of a rank, and
the one pseudo-address). Reads the model stage only.
"""
