"""The source formats: one module each, registered by name.

==================  ==========  ===========================================
module              access      count / read
==================  ==========  ===========================================
``items.py``        inline      ``len(items)`` / the payload objects
``jsonl.py``        pointer     line index, cached on disk / range reads
(``.gz``, ``.zst``) stream      one streaming pass, cached / ``stream()``
``parquet.py``      pointer     file metadata / the needed row groups
``text_files.py``   pointer     1 per file / the whole file
==================  ==========  ===========================================

``common.py`` holds what the file formats share and ``registry.py`` the
format interface (:class:`SourceFormat`) and the registry the builders and
the command line read. Importing this package registers the built-in
formats, in the order above.
"""

# Imported for their registration (each module ends with ``register(...)``); the
# interface and the registry are in ``registry.py``.
from zephon_torch.sources.formats import items, jsonl, parquet, text_files

__all__ = ["items", "jsonl", "parquet", "text_files"]
