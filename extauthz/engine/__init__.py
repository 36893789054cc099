"""The engine: snapshots and the decision, the store's protection, release, the answers
both doors give, policy reload, and the state /status reports."""
