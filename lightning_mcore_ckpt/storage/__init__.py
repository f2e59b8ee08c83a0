"""Where a step's bytes go and how they get there durably: atomic writes (``atomic``), one
writer per directory (``lock``, ``store_lock``, who holds one: ``holders``, their one
``heartbeat``), the S3 client (``object_store``), a view's files read by range from a store
(``remote_files``); a step's seal (``seal``) and the tiers it is published to, behind one
interface (``tier``: ``local_tier``, ``store_tier``); a step's publication to a store
(``publication``) and a store read through local views (``store_views``).
"""
