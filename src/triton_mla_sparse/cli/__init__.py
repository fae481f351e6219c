"""Command line: ``triton-mla-sparse verify | bench | doctor``."""
