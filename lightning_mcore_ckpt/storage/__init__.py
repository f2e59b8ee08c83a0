"""Where a step's bytes go and how they get there durably: atomic writes (``atomic``), one
writer per directory (``lock``, ``holders``, ``store_lock``), the object store and its remote
files (``objects``), and a step's publication to a store (``publication``).
"""
