"""Tools over the whole pipeline: a pair and its requests as one value (``scenario``) and its picture
(``draw``), used by the ``kvgeom`` command."""
