"""Stage 3, the pairing rules: whether two ranks can exchange a request, who talks to whom, and what each
pair of ranks exchanges.

``handshake`` (the checks: every refusal names its field and both values), ``tp`` and ``dcp`` (tensor and
decode-context parallel mappings), ``blocksize`` (block-size ratios), ``streams`` and ``layerroute``
(which streams pair bytes), ``route`` (kvgeom mode's slices per remote rank). Reads the model and layout
stages only.
"""
