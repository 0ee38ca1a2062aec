"""Adapters that turn kvgeom's plans into real transfers.

Each sub-package wraps one transport library and imports it lazily, so that importing ``adapters`` (or
``kvgeom``) never pulls in torch or a transport library.
"""
