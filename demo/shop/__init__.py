"""The demo's business app: orders, and a record of every receipt the worker sent."""
