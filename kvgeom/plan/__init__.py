"""Stages 4-6, the plan: what a pair prepares once at handshake, one request bound onto it, and the
request lowered to descriptor ids and byte moves.

``pairing`` (:class:`~kvgeom.plan.pairing.Pairing`: the per-pair plan, its tables computed once);
``dlist``, ``strided`` and ``splits`` (the descriptor tables it prepares); ``planmemo`` (what planning
learns per pair, kept beside the pairing, never in it); ``align``, ``regionmap`` and ``exchange`` (which
blocks and tokens of a request pair up); ``descids`` (descriptor ids into the prepared tables); ``blockrows`` (the byte rows of a request's blocks,
and rows as the fewest runs: what every transport zeroes); ``recipe``
(a request shape's plan as one gather); ``request`` (:func:`~kvgeom.plan.request.plan_request`, the
receive step). Reads every earlier stage.
"""
