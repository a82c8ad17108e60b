"""Built-in context-proxy plugins: fold, ledger, usage and the jsonlog example."""
