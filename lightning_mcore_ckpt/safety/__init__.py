"""Opening a checkpoint never runs code from it: pickles (``safe_load``) and torch DCP
indexes (``safe_dcp``) are checked before they are read.
"""
