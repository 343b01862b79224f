"""The multi-host harness: Ray hosts as network namespaces on one machine (``harness``, ``network``)."""
