"""The public functions, one module per kind of call; each reads ingest -> check -> plan -> run ->
export (common.py holds the steps they share)."""
